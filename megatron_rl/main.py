"""Command line: ``python -m megatron_rl.main [recipe=NAME] [key=value ...]``.

Recipes are Hydra YAMLs under recipes/ composed onto the structured schema; any key can be
overridden (``trainer.total_steps=50 algo.group_size=8``). Errors in config or data print one
line naming the problem and exit with status 2.
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Callable, List, Optional

USAGE = """usage: python -m megatron_rl.main [recipe=tiny_cpu] [--print-config] [key=value ...]
  recipe=NAME      a recipe in $MEGATRON_RL_RECIPE_PATH's folders or recipes/ (default tiny_cpu),
                   or the path of a .yaml file (a recipe of your own, a run's config.yaml)
  --print-config   print the resolved config and exit
  key=value        any config override, e.g. trainer.total_steps=50 algo.group_size=8"""


def run_guarded(run: Callable[[], Optional[dict]], prog: str = "megatron_rl") -> int:
    """Run a trainer; errors a user can act on become one line on stderr and an exit status:
    2 for a ``UserError`` (config, data, checkpoint, run directory), 1 for a run that had to stop
    (an engine or a rank gone), ``STOPPED_EXIT`` for a stop on request (checkpoint written).
    The status is also written where ``MEGATRON_RL_EXIT_FILE`` says (``stop.record_exit``): torchrun
    reports any failed rank as 1, and the batch script decides from the trainer's own status."""
    from .errors import UserError, one_line, report
    from .learner.group import LearnerRanksFailed
    from .plugins import PluginError
    from .scheduler.controller import RolloutsStopped
    from .stop import STOPPED_EXIT, StopRequested, record_exit
    from .telemetry.run_dir import note_in_run_log

    try:
        summary = run()
    except (UserError, PluginError) as err:
        # The reason reaches logs/train.log too, when the run directory was made before it.
        note_in_run_log(one_line(err), prog)
        return record_exit(report(err, prog))
    except (RolloutsStopped, LearnerRanksFailed) as err:
        note_in_run_log(str(err), prog)
        print(f"{prog}: error: {err}", file=sys.stderr)
        return record_exit(1)
    except StopRequested as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return record_exit(STOPPED_EXIT)
    except BaseException as err:
        # A bug (or Ctrl-C): the traceback goes to stderr as Python prints it, and to train.log.
        if isinstance(err, Exception):
            note_in_run_log(f"unexpected error:\n{traceback.format_exc().rstrip()}", prog)
        else:
            note_in_run_log(f"interrupted ({type(err).__name__})", prog)
        record_exit(1)
        raise
    if summary is not None:
        print(json.dumps(summary))
    return record_exit(0)


def main(argv: Optional[List[str]] = None) -> int:
    from .checks import load_config
    from .errors import ConfigError
    from .config.load import recipe_name
    from .errors import report
    from .stop import record_exit

    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(USAGE)
        return 0
    recipe = "tiny_cpu"
    print_only = "--print-config" in args
    overrides = []
    for arg in args:
        if arg.startswith("recipe="):
            recipe = arg.split("=", 1)[1]
        elif arg != "--print-config":
            overrides.append(arg)
    try:
        cfg = load_config(recipe, overrides)
    except ConfigError as err:
        return record_exit(report(err))
    cfg.trainer.recipe = recipe_name(recipe, cfg.trainer.recipe)
    if print_only:
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
        return 0

    def run():
        from .build import build_trainer

        return build_trainer(cfg).run()

    return run_guarded(run)


if __name__ == "__main__":
    from megatron_rl.lifetime import skip_final_gc

    skip_final_gc()  # first: its atexit handler must run last
    sys.exit(main())
