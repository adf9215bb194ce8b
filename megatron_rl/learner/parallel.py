"""Process-group set-up for the learner: torch.distributed + Megatron's parallel_state."""

from __future__ import annotations

import logging
import os
import socket

import torch
import torch.distributed as dist

from ..models.cpu_patches import apply_cpu_patches, cuda_available

logger = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed(timeout=None) -> None:
    """Join the torchrun world if launched by torchrun; otherwise form a world of one process.

    A world of one uses a private TCP port and leaves the environment untouched, so processes
    this one starts (tests, tools) do not inherit a rendezvous address already in use.
    """
    if dist.is_initialized():
        return
    backend = "nccl" if cuda_available() else "gloo"
    options = {} if timeout is None else {"timeout": timeout}
    if cuda_available() and "LOCAL_RANK" in os.environ:
        # torchrun's placement; a world of one keeps the current device (cuda:0 unless the
        # process chose another, as an engine process on rollout.device=cuda:N does).
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend=backend, **options)
    else:
        dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{free_port()}",
                                rank=0, world_size=1)
    logger.info("torch.distributed up: backend=%s world=%d", backend, dist.get_world_size())


def init_model_parallel(tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1, seed: int = 0) -> None:
    """Initialise Megatron's parallel_state (idempotent for the same layout) and its RNG tracker."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    apply_cpu_patches()
    init_distributed()
    if parallel_state.model_parallel_is_initialized():
        same = (parallel_state.get_tensor_model_parallel_world_size() == tp
                and parallel_state.get_pipeline_model_parallel_world_size() == pp)
        if not same:
            raise RuntimeError("Megatron parallel_state is already initialised with another layout")
    else:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
            context_parallel_size=cp,
        )
    model_parallel_cuda_manual_seed(seed)


def destroy() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
