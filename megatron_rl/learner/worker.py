"""A learner rank's part of a run: everything that runs on every learner rank at once.

The driver (rank 0) decides what happens; every learner rank, the driver included, runs the same
``LearnerWorker`` method with the same arguments (``group.py`` carries the calls), because each
is collective over the learner ranks: a training step (Megatron's TP/PP/DP collectives), a
checkpoint (dist_checkpointing), a weight send (gathers over TP/EP, broadcasts to the engines).
In a world of one process the driver is the only learner rank and the calls are plain calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..checkpoint import load_checkpoint, save_checkpoint
from ..checkpoint.resume import load_newest_good
from ..config.schema import RootConfig
from ..trajectory_buffers import TrajectoryBuffers, unpack
from ..types import Trajectory
from .critic import Critic
from .learner import Learner
from .data_parallel import dp_size_rank
from .recipes import recipe_for
from .shares import BatchIndex
from .train_batch import TrainBatch

logger = logging.getLogger(__name__)

# Under LoRA, trainer.export_hf also writes the adapters as a PEFT directory here, beside ``hf``.
PEFT_EXPORT_DIR = "peft"


class LearnerWorker:
    """Policy learner (and critic, for PPO with GAE) of this rank.

    ``weights_sender``: this rank's side of the weight transport (``weights/transports.py``:
    broadcast to the engine ranks, or load this rank's own engine); none in one process, where
    the driver hands the weights to its engine itself. ``local_engine``: colocated placement,
    this rank's engine and the event loop its client lives on (put to sleep while training)."""

    def __init__(self, cfg: RootConfig, vocab_size: int, pad_id: int, weights_sender=None,
                 local_engine: Optional[Tuple[Any, asyncio.AbstractEventLoop]] = None):
        self.cfg = cfg
        self.learner = Learner(cfg, vocab_size, pad_id=pad_id)
        self.recipe = recipe_for(cfg.algo.name)
        # PPO with GAE: a value model with the policy's layout, starting from its weights.
        self.critic = Critic(cfg, vocab_size, pad_id, self.learner.module) if self.recipe.critic else None
        self.weights_sender = weights_sender
        self.local_engine = local_engine
        self.timeline = None  # the other learner ranks' spans (the driver records its own)

    def open_timeline(self, run_dir: str) -> None:
        """The other learner ranks add their spans (train, sync, checkpoint) to the run's
        timeline, tagged with their rank."""
        if self._sharded() and dist.get_rank() != 0:
            from ..telemetry.metrics import Timeline

            self.timeline = Timeline(Path(run_dir) / "timeline.jsonl", rank=dist.get_rank())

    def _span(self, name: str, **attrs):
        return self.timeline.span(name, **attrs) if self.timeline is not None else contextlib.nullcontext()

    @property
    def vocab_size(self) -> int:
        return self.learner.vocab_size

    # ---------------------------------------------------------------- a step
    def train(self, groups: List[List[Trajectory]], version: int, lr: float,
              teachers: Optional[List[str]] = None) -> Dict[str, float]:
        """One update of policy ``version`` on these scored groups, every rank holding all of
        them (one process; each rank keeps its replica's share): see ``train_share``.
        ``teachers``: each group's teacher name (distillation from several teachers)."""
        whole = TrainBatch.of_groups(groups, teachers)
        rank, dp = self.replica()
        index = whole.index.share(self.cfg.learner.mini_batches, dp, rank)
        return self.train_share([whole[i] for i in index.rows], index, version, lr)

    def replica(self) -> Tuple[int, int]:
        """(this rank's data-parallel replica, the number of replicas)."""
        size, rank = dp_size_rank()
        return rank, size

    def receive_rows(self, buffers: TrajectoryBuffers) -> List[Trajectory]:
        """The trajectories of the rows the driver sent this rank (learner/group.py)."""
        return unpack(buffers)

    def train_share(self, trajs: List[Trajectory], index: BatchIndex, version: int, lr: float) -> Dict[str, float]:
        """One update of policy ``version`` on this replica's share of the step's scored batch
        (``trajs``, the rows ``index.rows``; learner/group.py sends each rank its own): the
        algorithm's recipe fills the batch (rewards trained on, advantages, ...), the learner
        updates, then what the recipe runs after (the critic's update)."""
        batch = TrainBatch.share(trajs, index)  # the trajectories are frozen from here on
        self._sleep_local_engine()
        batch, metrics = self.recipe.prepare(self, batch)
        with self._span("train", step=version + 1):
            metrics.update(self.learner.train_step(batch, self.cfg.rollout.temperature, lr, version))
            metrics.update(self.recipe.after_update(self, batch, lr))
        return metrics

    # ---------------------------------------------------------------- weights out
    def hf_weights(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """Every full HF-named tensor, on every learner rank (collective when sharded)."""
        return self.learner.export_hf_weights()

    def _sharded(self) -> bool:
        return dist.is_initialized() and dist.get_world_size() > 1  # the learner ranks' world

    def send_weights(self, version: int) -> Optional[float]:
        """This rank's side of a weight push: gather ``version`` over TP/EP (and PP where every
        rank needs every stage) and send it on. Returns a stage source's seconds (None
        elsewhere)."""
        with self._span("sync", version=version):
            return self.weights_sender.send(self.learner, version)

    def logprobs(self, trajs: List[Trajectory], temperature: float) -> List[List[float]]:
        """Per-token logprobs of ``trajs`` under the current weights (every learner rank runs it)."""
        return self.learner.compute_logprobs(trajs, temperature)

    def _sleep_local_engine(self) -> None:
        """Colocated and synchronous: the engine gives its accelerator memory back while the
        learner trains (a no-op for the embedded engine on CPU); the weight push wakes it."""
        if self.local_engine is not None and self.cfg.scheduler.max_staleness == 0:
            engine, loop = self.local_engine
            asyncio.run_coroutine_threadsafe(engine.sleep(), loop).result()

    # ---------------------------------------------------------------- checkpoints
    def weights_finite(self) -> bool:
        """Whether every weight (policy and critic) on every learner rank is finite; the driver
        asks before each checkpoint, so none is ever written with NaN or inf weights."""
        from .megatron_step import weights_finite

        finite = self.learner.weights_finite()
        return (weights_finite(self.critic.model) and finite) if self.critic is not None else finite

    def save(self, root: str, step: int, state: Dict[str, Any], export_dir: Optional[str] = None,
             tokenizer_dir: Optional[str] = None) -> str:
        """One checkpoint of the whole learner (every rank writes its shards), and optionally its
        weights as a Hugging Face directory (gathered on every rank, written by rank 0)."""
        with self._span("checkpoint", step=step):
            path = save_checkpoint(self.learner, Path(root), step, state, keep=self.cfg.trainer.checkpoint_keep,
                                   critic=self.critic)
        if export_dir is not None:
            from ..models.convert import export_hf_checkpoint

            tensors = list(self.hf_weights())
            if not dist.is_initialized() or dist.get_rank() == 0:
                export_hf_checkpoint(tensors, self.cfg.model, self.vocab_size, path / export_dir,
                                     tokenizer_dir=tokenizer_dir)
            if self.learner.lora:
                self._export_peft(path / PEFT_EXPORT_DIR)
        return str(path)

    def _export_peft(self, out: Path) -> None:
        """Under LoRA, beside the merged HF export: the adapters as a PEFT directory naming the
        HF ``model.path`` as its base (collective: the adapters are gathered on every rank)."""
        from ..models.lora_checkpoint import write_peft_from_learner
        from ..weights.adapters import all_adapter_tensors

        adapters = all_adapter_tensors(self.learner.module)
        if not dist.is_initialized() or dist.get_rank() == 0:
            path = self.cfg.model.path
            base = str(Path(path).resolve()) if path and (Path(path) / "config.json").is_file() else None
            write_peft_from_learner(out, adapters, self.cfg.model, self.cfg.lora, base)

    def resume(self, root: str) -> Optional[Tuple[str, Dict[str, Any]]]:
        """Load the newest loadable checkpoint under ``root`` (None if there is none)."""
        found = load_newest_good(Path(root), lambda path: load_checkpoint(self.learner, path, critic=self.critic))
        return None if found is None else (str(found[0]), found[1])

    # ---------------------------------------------------------------- stop requests
    def any_rank_asked(self, asked: bool) -> bool:
        """Whether any learner rank was asked to stop (a signal reaches each rank on its own)."""
        from ..stop import local_stop_requested

        asked = asked or local_stop_requested()
        if self._sharded():
            flag = torch.tensor([1.0 if asked else 0.0], device=self.learner.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            asked = bool(flag.item())
        return asked
