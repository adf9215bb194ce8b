"""The embedded rollout engine: our Megatron GPTModel, KV-cached, behind the async RolloutEngine API.

One background task runs the batch on a dedicated compute thread (so the event loop stays free
for rewards and the trainer) and streams each step's tokens to the requests. Batching is
continuous: when enough requests are waiting (or the batch has thinned out) and they fit the KV
cache, the batch is rebuilt with the running requests plus the newcomers, so a few long responses
never hold the engine at a handful of rows. Pause, abort and weight swaps take effect between
steps; every token is tagged with the version that sampled it. While nobody is waiting to join,
or the batch is full (nobody can join before a row finishes), the compute thread decodes several
steps in a row (a burst) before it hands the tokens to the event loop: the hand-off costs about as
much as a small model's decode step on a CPU, and on a GPU a burst launches each step ahead. A burst ends
where the one-step loop would have done something else (compact finished rows, admit a newcomer,
pause, abort), so it samples the same tokens. After new weights the running
requests are re-prefilled (``recompute_kv_on_update``, so every later token comes from the new
policy alone) or keep their cache entries (cheaper; the logprobs recorded are still exactly those
of the distribution sampled from). A request with ``SamplingParams.seed`` set draws from its own
random stream, keyed by (seed, request id) and positioned by its token count, so its tokens do not
depend on the batch or the engine that serves it, and a re-prefill continues the stream.

A mixture of experts records its routing (``record_routing``, on by default for MoE models): for
every position the engine computes for a request, each MoE layer's chosen experts, returned on the
request's chunks (``GenerationChunk.routed_experts``) for routing replay in the learner. A position
keeps the routing of the forward that first computed it: re-prefilling a request (new weights, a
rebuilt batch) computes its earlier positions again but does not change their record.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Deque, Dict, Iterable, List, Optional, Sequence, Set, Tuple, Union

import numpy as np
import torch

from ...config.schema import LoraConfig, ModelConfig, RootConfig
from ...models.gpt import build_gpt_model, model_device
from ...models.hf_names import hf_to_megatron
from ...models.lora import add_lora, is_adapter_name
from ...trajectory_buffers import response_arrays
from ...types import GenerationChunk, SamplingParams
from ...api.engine import EngineError, EngineStats, RolloutEngine  # noqa: F401 - EngineStats: its old home
from ..long_tail import LongTailLengths
from ..sampling import Stream, request_key
from .generator import KVCachedGenerator, PendingStep, Sampled

logger = logging.getLogger(__name__)

# Most decode steps one burst runs on the compute thread before the event loop sees its tokens:
# finished requests wait at most this many steps to be reported.
DECODE_BURST = 16


class _Group:
    """The requests of one ``generate_n`` call, answered together: one future for the group
    instead of a stream (an asyncio queue, generator and task) per request. At ~250 requests a
    step, those made up a third of the engine process's event-loop time, time it takes from the
    compute thread (the two share the GIL)."""

    def __init__(self, size: int):
        self.future: asyncio.Future = asyncio.get_running_loop().create_future()
        self.responses: List[Optional[GenerationChunk]] = [None] * size
        self.waiting = size

    def deliver(self, index: int, response: GenerationChunk) -> None:
        if self.future.done():
            return
        self.responses[index] = response
        self.waiting -= 1
        if not self.waiting:
            self.future.set_result(self.responses)

    def fail(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)


def cut_at_finish(tokens: Sequence[int], stops: tuple, remaining: int) -> Tuple[int, Optional[str]]:
    """The finish rule, for a row's next ``tokens`` when ``remaining`` tokens of its budget are
    left before them: how many it keeps and why it then finishes ("stop": a stop token, kept;
    "length": the budget spent; None: it goes on). One token or a burst's: the event loop's
    recording and the compute thread's look-ahead both ask here."""
    kept = tokens[: max(remaining, 1)]
    if stops and (kept[0] in stops if len(kept) == 1 else not set(stops).isdisjoint(kept)):
        return next(i for i, token in enumerate(kept) if token in stops) + 1, "stop"
    return len(kept), "length" if remaining <= len(kept) else None


@dataclass
class _Request:
    request_id: str
    prompt_ids: List[int]
    params: SamplingParams
    # Where the request's output goes: a queue of chunks (``generate``), or its place in a group.
    queue: Optional["asyncio.Queue"] = None
    group: Optional[Tuple[_Group, int]] = None
    tokens: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    versions: List[int] = field(default_factory=list)
    finish: Optional[str] = None
    emitted: int = 0
    closed: bool = False  # the final chunk was sent
    # Routing of the positions computed so far (MoE models recording it): [positions, moe
    # layers, top_k] arrays in position order; ``routed`` positions in all, the first
    # ``routing_emitted`` arrays already sent in a chunk.
    routing: List[np.ndarray] = field(default_factory=list)
    routed: int = 0
    routing_emitted: int = 0
    # Key of the request's random stream (None: unseeded, the engine's generator draws its tokens).
    key: Optional[int] = field(init=False, default=None)
    # A benchmark's forced response length (rollout/long_tail.py): the request's stop tokens are
    # ignored and it ends at this many tokens. None: its own max_new_tokens and stop tokens.
    forced_length: Optional[int] = None

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.key = request_key(self.params.seed, self.request_id)

    @property
    def stream(self) -> Optional[Stream]:
        """Where the request's next draw lies in its stream: the tokens it has so far."""
        return None if self.key is None else (self.key, len(self.tokens))

    @property
    def sampler(self) -> Tuple[float, float, int]:
        """What the batch's one sampling call needs equal across rows (stops, lengths and
        streaming are per row)."""
        return self.params.temperature, self.params.top_p, self.params.top_k

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.tokens)

    @property
    def remaining(self) -> int:
        budget = self.params.max_new_tokens if self.forced_length is None else self.forced_length
        return budget - len(self.tokens)

    @property
    def stop_token_ids(self) -> tuple:
        """The tokens that end this request: none under a forced length."""
        return self.params.stop_token_ids if self.forced_length is None else ()

    def add_routing(self, computed: np.ndarray) -> None:
        """The routing of this request's last ``len(computed)`` positions (those up to its
        current length), as a forward just computed them; positions recorded before keep their
        first record."""
        first = self.length - len(computed)
        if first > self.routed:
            raise RuntimeError(f"request {self.request_id}: routing of positions {self.routed}..{first - 1} "
                               "was never recorded")
        new = computed[self.routed - first :]
        if len(new):
            self.routing.append(new)
            self.routed += len(new)

    def take_routing(self, whole: bool) -> Optional[np.ndarray]:
        """The routing not yet sent (``whole``: all of it), one array; None when none is recorded."""
        if not self.routing:
            return None
        parts = self.routing if whole else self.routing[self.routing_emitted :]
        self.routing_emitted = len(self.routing)
        if not parts:
            return np.zeros((0, *self.routing[0].shape[1:]), dtype=self.routing[0].dtype)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


def bind_thread_to_device(device: torch.device) -> None:
    """Initializer of a compute thread. CUDA's current device is per thread, and a new thread
    starts on cuda:0 whatever its creator chose; Megatron builds tensors on the current device
    during the forward (seen on 2 H200s: an engine on cuda:1 met cuda:0 tensors and every request
    failed). No-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def engine_options(cfg: RootConfig) -> Dict[str, Union[bool, int, Optional[LongTailLengths]]]:
    """The settings an embedded engine takes as keyword arguments, wherever it is built (in the
    trainer's process, in a process of its own, on an engine rank)."""
    rollout = cfg.rollout
    long_tail = None
    if rollout.long_tail_median:
        long_tail = LongTailLengths(rollout.long_tail_median, rollout.long_tail_p99, cfg.trainer.seed)
    return dict(recompute_kv_on_update=rollout.recompute_kv_on_update, cuda_graphs=rollout.cuda_graphs,
                record_routing=rollout.record_routing, max_seq_len=engine_context_tokens(cfg), long_tail=long_tail)


def engine_context_tokens(cfg: RootConfig) -> int:
    """Tokens of prompt + response one engine row holds: ``rollout.max_model_len``, else what a
    single-turn rollout can need, else (agents) the model's context."""
    from ..workflow import is_agent

    if cfg.rollout.max_model_len is not None:
        return cfg.rollout.max_model_len
    if is_agent(cfg.rollout.workflow):
        return cfg.model.max_position_embeddings
    return min(cfg.model.max_position_embeddings, cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens)


class EmbeddedEngine(RolloutEngine):
    def __init__(self, model_cfg: ModelConfig, vocab_size: int, max_batch_size: int = 256,
                 seed: int = 0, version: int = 0, executor: Optional[ThreadPoolExecutor] = None,
                 recompute_kv_on_update: bool = False, cuda_graphs: bool = True, record_routing: bool = True,
                 max_seq_len: Optional[int] = None, lora: Optional[LoraConfig] = None,
                 static_decode: bool = False, long_tail: Optional[LongTailLengths] = None):
        """``executor``: the thread to compute on; pass the learner's when the two never run at
        once (η = 0), so one thread team owns the CPU cores. By default the engine has its own.
        ``record_routing``: a mixture of experts returns its routing on the chunks (see above).
        ``max_seq_len``: prompt + response tokens a row holds (``engine_context_tokens``; default
        the model's max_position_embeddings). ``lora``: the model carries the learner's LoRA
        adapters and applies them unmerged (base matmul + low-rank path, in prefill and decode);
        ``update_weights`` then takes adapter tensors under their Megatron names (``...lora_a``)
        beside or without the base's HF tensors. ``static_decode``: the static-shape decode step
        without CUDA graphs, on a CPU too (tests count its bucket captures). ``long_tail``: a
        benchmark's forced response lengths (rollout/long_tail.py)."""
        self.model_cfg = model_cfg
        self.model = build_gpt_model(model_cfg, vocab_size, kv_attention=True)
        self.lora = lora is not None and lora.rank > 0
        if self.lora:  # B starts at zero: the base model until the first adapters arrive
            add_lora(self.model, lora.rank, lora.alpha, 0.0, lora.targets)
        self.model.eval()
        self.device = model_device()
        self._gen = KVCachedGenerator(self.model, max_batch_size, max_seq_len or model_cfg.max_position_embeddings,
                                      self.device, seed=seed, cuda_graphs=cuda_graphs,
                                      static_decode=static_decode, record_routing=record_routing)
        self.long_tail = long_tail
        self._version = version
        self._recompute_kv_on_update = recompute_kv_on_update
        self._owns_executor = executor is None
        self._executor = executor or ThreadPoolExecutor(1, thread_name_prefix="embedded-engine",
                                                        initializer=bind_thread_to_device, initargs=(self.device,))
        self._pending: Deque[_Request] = deque()
        self._running: Dict[str, _Request] = {}  # taken from the queue, final chunk not yet sent
        self._batch: List[_Request] = []  # the KV cache's rows, in order (finished rows included)
        self._aborted: Set[str] = set()
        self._paused = False
        self._kv_stale = False  # weights changed under the running rows: re-prefill them
        self._task: Optional[asyncio.Task] = None
        self._wakeup: Optional[asyncio.Event] = None
        self._step_lock: Optional[asyncio.Lock] = None
        self._failure: Optional[BaseException] = None
        self._arrivals = 0  # requests queued so far: a new one ends a decode burst
        # Launch each decode step before the previous one's tokens are read (decode_graphs.py: on a
        # GPU the host's per-step work then overlaps the step). Off on a CPU, where a launch is the
        # computation itself and a burst's extra step would only cost time.
        self.decode_lookahead = self.device.type == "cuda"
        # A decode step a burst launched before returning (look-ahead), not yet recorded: it runs
        # while the event loop records the burst's tokens. ``_settle`` records it before anything
        # changes the batch, the weights or the random generator.
        self._inflight: Optional[PendingStep] = None
        self.stats = EngineStats()

    # ------------------------------------------------------------------ API
    def weight_version(self) -> int:
        return self._version

    def generate(self, request_id: str, prompt_ids: Sequence[int],
                 params: SamplingParams) -> AsyncIterator[GenerationChunk]:
        """The request joins the queue now, not at the stream's first step: an abort made after
        this call (e.g. the next message from the trainer's process) always finds it."""
        self._check_request(request_id, prompt_ids, params)
        req = self._request(request_id, list(prompt_ids), params, queue=asyncio.Queue())
        self._enqueue([req])
        return self._stream(req)

    def generate_n(self, request_ids: Sequence[str], prompt_ids: Sequence[int],
                   params: SamplingParams) -> Awaitable[List[GenerationChunk]]:
        """As the base class's (every response whole, in request order; the requests join the
        queue now), without a stream per request. Cancelling the result aborts the requests."""
        self._check_request(request_ids[0] if request_ids else "", prompt_ids, params)
        group = _Group(len(request_ids))
        prompt = list(prompt_ids)
        self._enqueue([self._request(rid, prompt, params, group=(group, i)) for i, rid in enumerate(request_ids)])
        group.future.add_done_callback(lambda done: done.cancelled() and self._abort_now(set(request_ids)))
        if not request_ids:
            group.future.set_result([])
        return group.future

    def _request(self, request_id: str, prompt: List[int], params: SamplingParams, **output) -> _Request:
        req = _Request(request_id, prompt, params, **output)
        if self.long_tail is not None:
            req.forced_length = self.long_tail.draw(request_id, params.max_new_tokens)
        return req

    def _check_request(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        self._ensure_started()
        if self._failure is not None:
            raise EngineError(f"embedded engine is dead: {self._failure!r}")
        if not prompt_ids:
            raise EngineError(f"request {request_id}: empty prompt")
        try:
            self._gen.check_request(len(prompt_ids), params.max_new_tokens)
        except ValueError as err:
            raise EngineError(f"request {request_id}: {err}") from None

    def _enqueue(self, requests: List[_Request]) -> None:
        self._pending.extend(requests)
        self._arrivals += len(requests)
        self.stats.requests += len(requests)
        self._wakeup.set()

    async def _stream(self, req: _Request) -> AsyncIterator[GenerationChunk]:
        finished = False
        try:
            while True:
                item = await req.queue.get()
                if isinstance(item, BaseException):
                    raise _request_failed(req, item) from item
                yield item
                if item.finish_reason is not None:
                    finished = True
                    return
        finally:
            if not finished:  # the caller stopped listening: free the slot
                self._abort_now({req.request_id})

    async def sampling_state(self) -> Optional[bytes]:
        async with self._lock():  # not in the middle of a sampling step
            self._settle()
            return bytes(self._gen.generator.get_state().tolist())

    async def set_sampling_state(self, state: Optional[bytes]) -> None:
        if state is not None:
            async with self._lock():
                self._settle()
                self._gen.generator.set_state(torch.tensor(list(state), dtype=torch.uint8))

    def _lock(self) -> asyncio.Lock:
        self._ensure_started()
        return self._step_lock

    async def abort(self, request_ids: Optional[Iterable[str]] = None) -> None:
        self._abort_now(set(request_ids) if request_ids is not None else None)

    def _abort_now(self, ids: Optional[Set[str]]) -> None:
        keep: Deque[_Request] = deque()
        for req in self._pending:
            if ids is None or req.request_id in ids:
                req.finish = "abort"
                self._emit(req)
            else:
                keep.append(req)
        self._pending = keep
        self._aborted.update(self._running if ids is None else ids & set(self._running))
        if self._wakeup is not None:
            self._wakeup.set()  # a paused engine finishes aborted rows now

    async def pause(self, mode: str = "keep") -> None:
        if mode not in ("keep", "abort"):
            raise ValueError(f"pause mode {mode!r}: choose 'keep' or 'abort'")
        self._ensure_started()
        self._paused = True
        if mode == "abort":
            await self.abort()
        async with self._step_lock:  # returns once the step in progress (if any) has finished
            self._settle()

    async def resume(self) -> None:
        self._ensure_started()
        self._paused = False
        self._wakeup.set()

    async def update_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]], version: int) -> None:
        if not self._paused:
            raise EngineError("update_weights needs a paused engine: call pause() first")
        hf = dict(named_tensors)
        await asyncio.get_running_loop().run_in_executor(self._executor, self._load, hf)
        self._version = version
        self._kv_stale = self._recompute_kv_on_update

    async def shutdown(self) -> None:
        if self._task is not None:
            await self.abort()
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self._owns_executor:
            self._executor.shutdown(wait=True)

    # ------------------------------------------------------------------ internals
    @torch.no_grad()
    def _load(self, hf: Dict[str, torch.Tensor]) -> None:
        """Copy the incoming tensors into the model's own (CUDA graphs stay valid): HF-named
        base weights (all of them, or none: an adapter-only update) and LoRA adapters under their
        Megatron names."""
        state = self.model.state_dict()
        adapters = {k: hf.pop(k) for k in [k for k in hf if is_adapter_name(k)]}
        if adapters and not self.lora:
            raise EngineError(f"LoRA adapters ({next(iter(adapters))!r}, ...) sent to an engine built without them: "
                              "build it with lora= (the trainer does under lora.sync=adapters)")
        names = [k for k, v in state.items() if isinstance(v, torch.Tensor) and not is_adapter_name(k)]
        incoming = hf_to_megatron(hf, names, self.model_cfg) if hf or not adapters else {}
        for name, tensor in [*incoming.items(), *adapters.items()]:
            if name not in state or state[name].shape != tensor.shape:
                have = tuple(state[name].shape) if name in state else "none"
                raise EngineError(f"weight {name}: engine shape {have} != incoming {tuple(tensor.shape)}")
            state[name].copy_(tensor)

    @property
    def _rows(self) -> List[_Request]:
        """The batch's unfinished rows, in row order."""
        return [r for r in self._batch if r.finish is None]

    def _ensure_started(self) -> None:
        if self._task is None:
            self._wakeup = asyncio.Event()
            self._step_lock = asyncio.Lock()
            self._task = asyncio.get_running_loop().create_task(self._serve(), name="embedded-engine")

    async def _compute(self, kind: str, fn, *args):
        """Run one model step (``kind``: prefill, admit or decode) on the compute thread; None if
        paused before it could start."""
        async with self._step_lock:
            if self._paused:
                return None
            start = time.perf_counter()
            out = await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
            took = time.perf_counter() - start
            self.stats.compute_s += took
            setattr(self.stats, f"{kind}_s", getattr(self.stats, f"{kind}_s") + took)
            self._count_captures()
            return out

    async def _capture_decode_buckets(self) -> None:
        """Before the first step: capture every decode bucket a run can reach, so admission into
        a running decode (or a width crossing) never captures one mid-run."""
        async with self._step_lock:
            await asyncio.get_running_loop().run_in_executor(self._executor, self._gen.capture_decode_buckets)
            self._count_captures()

    def _count_captures(self) -> None:
        self.stats.captures, self.stats.late_captures, self.stats.capture_s = self._gen.captures

    async def _serve(self) -> None:
        try:
            await self._capture_decode_buckets()
            while True:
                self._retire_aborted()
                if self._paused or not (self._rows or self._pending):
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                try:
                    await self._step()
                except Exception as err:  # noqa: BLE001 - one bad batch must not kill the engine
                    logger.exception("embedded engine step failed")
                    self._inflight = None
                    for req in list(self._running.values()):
                        self._close(req, err)
                    self._batch = []
        except asyncio.CancelledError:
            raise
        except BaseException as err:  # noqa: BLE001
            self._failure = err
            for req in list(self._pending) + list(self._running.values()):
                self._close(req, err)
            raise

    async def _step(self) -> None:
        """One model call: a rebuild, an admission of waiting requests, or a decode step."""
        if self._pending or self._kv_stale:  # the batch may change: its rows' last tokens first
            self._settle()
        running = self._rows
        if not running and not self._pending:
            return
        if not running or self._kv_stale:
            await self._rebuild(running, self._admissible(running, in_place=False))
            return
        joining = self._admissible(running, in_place=True)
        # Admit in blocks (each admission is a forward of its own), unless few are waiting.
        if joining and len(joining) >= min(len(self._pending), max(1, self._gen.max_batch_size // 8)):
            await self._admit(running, joining)
            return
        if not joining and self._pending:
            # The offset has run too far for anyone to join in place: rebuild once at least as
            # many newcomers as running rows would come in (the running rows are recomputed).
            rebuilt = self._admissible(running, in_place=False)
            if len(rebuilt) >= len(running):
                await self._rebuild(running, rebuilt)
                return
        finished = len(self._batch) - len(running)
        compact_at = max(8, len(self._batch) // 2)
        if finished >= compact_at:  # drop finished rows from the decode batch
            await self._admit(running, [])
            return
        budget, stop_at = DECODE_BURST, compact_at
        if self._pending:
            if len(running) < self._gen.max_batch_size:
                # Whether the waiting requests can join changes with the offset: one step, then
                # decide again.
                budget = 1
            else:
                # A full batch: nothing can join, rebuild or compact until a row finishes (then
                # its row is free), so a burst runs until then.
                stop_at = 1
        live = [None if req.finish is not None else (req.stop_token_ids, req.remaining) for req in self._batch]
        steps = await self._compute("decode", self._decode_burst, running[0].params, live, stop_at, budget)
        if steps:
            self._record_burst(steps)

    def _record_step(self, sampled: Sampled) -> None:
        self._record_burst([sampled])

    def _record_burst(self, steps: List[Sampled]) -> None:
        """Record a burst's decode steps for the batch's rows, as ``_record`` would step by step.
        The event loop does this while only the step left in flight keeps the GPU busy, so a
        row's tokens of the whole burst are appended at once, cut at its stop token or budget
        (256 rows x 16 steps: 0.3 ms against 1.0 ms one step at a time, on a CPU core). Rows
        that stream (a chunk per step), or steps with routing, go step by step."""
        self.stats.decode_steps += len(steps)
        if len(steps) == 1 or any(step.routing is not None for step in steps):
            for sampled in steps:
                self.stats.decode_rows += self._record(self._batch, sampled)
            return
        tokens = list(zip(*(step[0] for step in steps)))  # per row, its token at each step
        logprobs = list(zip(*(step[1] for step in steps)))
        version, recorded = self._version, 0
        for row, req in enumerate(self._batch):
            if req.finish is not None:
                continue
            if req.group is None and req.params.stream:  # a chunk per step, as it streams
                for tok, lp in zip(tokens[row], logprobs[row]):
                    self.stats.decode_rows += self._record([req], Sampled([tok], [lp], None))
                    if req.finish is not None:
                        break
                continue
            n, req.finish = cut_at_finish(tokens[row], req.stop_token_ids, req.remaining)
            req.tokens.extend(tokens[row][:n])
            req.logprobs.extend(logprobs[row][:n])
            req.versions.extend([version] * n)
            recorded += n
            if req.finish is not None:
                self._emit(req)
        self.stats.tokens += recorded
        self.stats.decode_rows += recorded

    def _settle(self) -> None:
        """Record the decode step left in flight by the last burst, if any. The event loop calls
        this while no burst runs: before a prefill or admission, and under the step lock."""
        if self._inflight is not None:
            step, self._inflight = self._inflight, None
            self._record_step(step.result())

    def _decode_burst(self, params: SamplingParams, live: List[Optional[Tuple[tuple, int]]], stop_at: int,
                      budget: int) -> List[Sampled]:
        """Compute thread: decode steps until ``budget`` steps ran or the event loop has work, i.e.
        every row finished, ``stop_at`` rows finished, a request arrived, a pause or an abort.
        ``live``: per batch row, (stop ids, remaining budget) or None once finished; the rows'
        finishes are tracked here as ``_record`` will find them. With ``decode_lookahead`` (and a
        budget over one step) the burst starts from the step the last one left in flight, and
        launches each step before reading the previous one's tokens, so the GPU works while the
        host checks stops. A burst that ends on its budget leaves the step it launched in flight
        (``_inflight``: it runs while the event loop records); one that ends for the event loop's
        work keeps that step as its last (rows that finished ignore its tokens)."""
        arrivals = self._arrivals
        finished = sum(state is None for state in live)
        steps = []
        pending, self._inflight = self._inflight or self._gen.decode_start(params), None
        while True:
            room = self._gen.offset < self._gen.cache_len  # a slot for one more step
            ahead = None
            if self.decode_lookahead and room and budget > 1:
                ahead = self._gen.decode_start(params)
            step = pending.result()
            steps.append(step)
            finished += self._track_finishes(live, step[0])
            event = (finished >= min(stop_at, len(live)) or self._paused or self._aborted
                     or self._arrivals != arrivals)
            if event or len(steps) >= budget:
                if ahead is not None and event:
                    steps.append(ahead.result())
                    self._track_finishes(live, steps[-1][0])
                elif ahead is not None:
                    self._inflight = ahead
                return steps
            pending = ahead or self._gen.decode_start(params)

    @staticmethod
    def _track_finishes(live: List[Optional[Tuple[tuple, int]]], tokens: List[int]) -> int:
        """Update each live row's (stop ids, remaining budget) for one step's tokens; the number of
        rows that finished with it."""
        finished = 0
        for row, state in enumerate(live):
            if state is None:
                continue
            stops, remaining = state
            if cut_at_finish(tokens[row : row + 1], stops, remaining)[1] is not None:
                live[row] = None
                finished += 1
            else:
                live[row] = (stops, remaining - 1)
        return finished

    async def _rebuild(self, running: List[_Request], joining: List[_Request]) -> None:
        self._settle()
        rows = running + joining
        self._take(joining)
        sampled = await self._compute("prefill", self._gen.prefill, [r.prompt_ids + r.tokens for r in rows],
                                      rows[0].params, _streams(rows))
        if sampled is None:  # paused first
            self._untake(joining)
            return
        self._batch, self._kv_stale = rows, False
        self.stats.prefills += 1
        self._record(rows, sampled)

    async def _admit(self, running: List[_Request], joining: List[_Request]) -> None:
        self._settle()  # (a compaction: no request waits, so _step has not)
        keep = [row for row, req in enumerate(self._batch) if req.finish is None]
        self._take(joining)
        sampled = await self._compute("admit", self._gen.admit, keep, [r.prompt_ids + r.tokens for r in joining],
                                      running[0].params, _streams(joining))
        if sampled is None:
            self._untake(joining)
            return
        self._batch = [self._batch[row] for row in keep] + joining
        if joining:
            self.stats.admissions += 1
        self._record(joining, sampled)

    def _take(self, joining: List[_Request]) -> None:
        for req in joining:
            self._pending.remove(req)
            self._running[req.request_id] = req

    def _untake(self, joining: List[_Request]) -> None:
        """Paused before the step ran: the newcomers wait at the head of the queue again."""
        for req in reversed(joining):
            del self._running[req.request_id]
            self._pending.appendleft(req)

    def _admissible(self, running: List[_Request], in_place: bool) -> List[_Request]:
        """Waiting requests that can join: same sampler settings, oldest first, while the rows
        fit the batch and the cache, either at the current offset (``in_place``; a request too
        long to join yet lets later ones pass, the offset only grows) or in a rebuilt batch."""
        if not self._pending:
            return []
        sampler = running[0].sampler if running else self._pending[0].sampler
        lengths = [r.length for r in running]
        remaining = [r.remaining for r in running]
        joining: List[_Request] = []
        for req in self._pending:
            if req.sampler != sampler:
                continue
            if in_place:
                if len(running) + len(joining) >= self._gen.max_batch_size:
                    break
                if self._gen.can_admit(len(running) + len(joining), req.length, req.remaining):
                    joining.append(req)
                continue
            if not self._gen.fits(lengths + [req.length], remaining + [req.remaining]):
                break  # keep arrival order: later requests wait behind this one
            joining.append(req)
            lengths.append(req.length)
            remaining.append(req.remaining)
        return joining

    def _record(self, rows: List[_Request], sampled: Sampled) -> int:
        """Append each row's sampled token, and the routing of the positions the call computed
        for it (finished rows of the batch are ignored); the number of rows recorded. This runs
        on the event loop for every row of a step while the next step computes (256 rows per
        step at ~4 ms a step), so its per-row work is kept small: the token count is added once,
        and a row is handed to ``_emit`` only when that sends something (it finished, or it
        streams)."""
        tokens, logprobs = sampled
        routing = sampled.routing
        version = self._version
        recorded = 0
        for row, (req, tok, lp) in enumerate(zip(rows, tokens, logprobs)):
            if req.finish is not None:
                continue
            if routing is not None:  # before the token: the call computed positions up to here
                req.add_routing(routing[row])
            recorded += 1
            _, req.finish = cut_at_finish((tok,), req.stop_token_ids, req.remaining)
            req.tokens.append(tok)
            req.logprobs.append(lp)
            req.versions.append(version)
            if req.finish is not None or (req.group is None and req.params.stream):
                self._emit(req)
        self.stats.tokens += recorded
        return recorded

    def _retire_aborted(self) -> None:
        for rid in list(self._aborted):
            req = self._running.get(rid)
            if req is not None and req.finish is None:
                req.finish = "abort"
                self._emit(req)
        self._aborted.clear()

    def _emit(self, req: _Request) -> None:
        if req.closed:
            return
        if req.group is not None:
            if req.finish is not None:
                group, index = req.group
                group.deliver(index, response_arrays(GenerationChunk(
                    req.request_id, req.tokens, req.logprobs, req.versions, req.finish,
                    routed_experts=req.take_routing(whole=True))))
                req.closed = True
                self._running.pop(req.request_id, None)
            return
        if req.finish is None and (req.emitted == len(req.tokens) or not req.params.stream):
            return
        new = slice(req.emitted, len(req.tokens))
        req.queue.put_nowait(GenerationChunk(req.request_id, req.tokens[new], req.logprobs[new],
                                             req.versions[new], req.finish,
                                             routed_experts=req.take_routing(whole=False)))
        req.emitted = len(req.tokens)
        if req.finish is not None:
            req.closed = True
            self._running.pop(req.request_id, None)

    def _close(self, req: _Request, error: BaseException) -> None:
        if not req.closed:
            req.closed = True
            if req.group is not None:
                req.group[0].fail(_request_failed(req, error))
            else:
                req.queue.put_nowait(error)
        self._running.pop(req.request_id, None)


def _streams(rows: List[_Request]) -> Optional[List[Optional[Stream]]]:
    """The rows' random streams for the generator; None when no row has one."""
    streams = [req.stream for req in rows]
    return streams if any(s is not None for s in streams) else None


def _request_failed(req: _Request, error: BaseException) -> EngineError:
    failed = EngineError(f"request {req.request_id} failed in the embedded engine: {error!r}")
    failed.__cause__ = error
    return failed
