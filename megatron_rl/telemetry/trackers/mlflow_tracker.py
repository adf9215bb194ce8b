"""MLflow: one MLflow run per run directory, in the experiment ``trainer.project``, at MLflow's
tracking URI (``MLFLOW_TRACKING_URI``: a server, ``sqlite:///path/mlflow.db``, or a file store;
unset: MLflow's default, ``sqlite:///mlflow.db`` in the working directory). A resumed run goes
back to the store its run was started in."""

from __future__ import annotations

import time
from typing import List

from . import Metrics, TrackedRun, Tracker, TrackerError, flatten, scalars
from ...errors import one_line

# MLflow's limit on a param's value (longer values are cut, with a mark).
MAX_PARAM_CHARS = 6000


class MlflowTracker(Tracker):
    def __init__(self, client, run_id: str, tracking_uri: str):
        self.client, self.run_id = client, run_id
        self.state = {"run_id": run_id, "tracking_uri": tracking_uri}

    def log(self, step: int, metrics: Metrics) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in scalars(metrics).items()])

    def close(self, finished: bool = True) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED" if finished else "FAILED")


def _params(config: dict) -> List:
    from mlflow.entities import Param

    out = []
    for key, value in flatten(config).items():
        text = "null" if value is None else str(value)
        out.append(Param(key, text if len(text) <= MAX_PARAM_CHARS else text[:MAX_PARAM_CHARS - 3] + "..."))
    return out


def open_tracker(run: TrackedRun) -> MlflowTracker:
    import mlflow
    from mlflow.exceptions import MlflowException

    uri = run.saved.get("tracking_uri") or mlflow.get_tracking_uri()
    try:
        client = mlflow.MlflowClient(tracking_uri=uri)
        run_id = run.saved.get("run_id")
        if run_id:
            client.get_run(run_id)
            client.update_run(run_id, status="RUNNING")
            client.set_tag(run_id, "megatron_rl.resumed_at_step", str(run.first_step))
        else:
            experiment = client.get_experiment_by_name(run.project)
            experiment_id = experiment.experiment_id if experiment else client.create_experiment(run.project)
            run_id = client.create_run(experiment_id, run_name=run.name,
                                       tags={"megatron_rl.run_dir": str(run.run_dir)}).info.run_id
            # Params are the config the run started with: MLflow cannot change one later.
            client.log_batch(run_id, params=_params(run.config))
    except MlflowException as err:
        raise TrackerError(f"trainer.loggers has mlflow, but MLflow could not start a run at {uri} "
                           f"({one_line(err)}): set MLFLOW_TRACKING_URI to a server or to sqlite:///<path>/mlflow.db, "
                           "or leave mlflow out of trainer.loggers") from None
    return MlflowTracker(client, run_id, uri)
