"""The embedded engine's decode step with static shapes, replayed from CUDA graphs on a GPU.

A decode step of a 1.5B model at batch 256 runs about 1,800 small kernels. Launched one by one
from Python, the GPU waits on the launches (measured on an H200: 50 ms of wall time for 6 ms of
kernels at batch 64). A CUDA graph records the step's kernels once and replays them with one
launch, but only if nothing in the step depends on host values that change between steps. So
the step here has static shapes:

- the new token's cache slot is a device tensor (``EngineKVContext.static_slot``): the keys'
  rotation and the cache write read it on the device instead of slicing by the Python offset
  (multi-latent attention too: models/mla.py, ``EngineMLASelfAttention``);
- attention reads a fixed number of slots (the offset rounded up to a bucket of ``WIDTH_STEP``)
  and masks the ones after the new token; masked slots get zero weight, so the logits are those
  of the exact-width step (up to float rounding);
- the batch is rounded up to a bucket of rows; rows past the live ones compute on whatever their
  cache holds and are ignored (every row's attention and MLP read only that row).

- mixture-of-experts layers route, sort tokens by expert and combine on the device, every token
  with exactly top-k rows (models/grouped_moe.py: ``GroupedMoELayer.without_host_sync``).

One graph is captured per (rows, slots) bucket, every bucket the engine can reach
(``reachable_buckets``: the row buckets up to the engine's batch times the width buckets up to its
cache) before the first step (``capture_all``): a bucket captured mid-run stalls the batch (a 3.6 s
admission was measured on an H200 when admission grew a 64-row decode into a 128-row bucket never
seen before). A bucket that somehow was not captured is captured on use and counted
(``late_captures``). All graphs share one memory pool (graphs never
run at once), all writing their logits into one buffer (and, when the engine records routing, every
MoE layer's chosen experts into another: a graph's own tensors are overwritten by its next replay,
and a layer's ``choices`` attribute points at the last captured graph's). Weight updates copy into the same
parameter tensors, so graphs stay valid. On a CPU (``capture=False``) the same static-shape step
runs eagerly: tests compare it with the eager step, and the same bucket registry decides what to
capture (an eager bucket's "capture" records nothing), so tests count captures.
Sampling stays outside the graph (it reads the engine's random generator and the rows' streams).
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple

import torch

from ...models.logits_target import logits_target

if TYPE_CHECKING:  # megatron-core is imported where a model is built, not with this module
    from ...models.grouped_moe import GroupedMoELayer

# Attention widths are multiples of this many slots: a step attends over at most this many
# masked slots more than it needs, and a batch's life crosses one bucket per this many tokens.
WIDTH_STEP = 256
# The first this many width buckets are every multiple of WIDTH_STEP; past them each bucket is an
# eighth wider than the last (rounded up to WIDTH_STEP): a long-context cache (2 x 16k tokens)
# then needs ~30 width buckets instead of ~130, every one captured at start, for at most 1/8 more
# masked slots.
LINEAR_WIDTH_BUCKETS = 16

Bucket = Tuple[int, int]  # (rows, attention width)


def row_bucket(rows: int, max_rows: int) -> int:
    """The captured batch size that serves ``rows`` live rows: the next power of two (at least 8),
    capped at the engine's largest batch."""
    bucket = 8
    while bucket < rows:
        bucket *= 2
    return min(bucket, max_rows)


def row_buckets(max_rows: int) -> List[int]:
    """Every batch size ``row_bucket`` returns for 1..max_rows live rows."""
    buckets = [8]
    while buckets[-1] < max_rows:
        buckets.append(buckets[-1] * 2)
    return sorted({min(b, max_rows) for b in buckets})


def width_buckets(cache_len: int) -> List[int]:
    """Every attention width a step over a cache of ``cache_len`` slots uses, ascending: the
    first ``LINEAR_WIDTH_BUCKETS`` multiples of ``WIDTH_STEP``, then an eighth wider each, the last capped
    at the cache's length."""
    widths = [WIDTH_STEP]
    while widths[-1] < cache_len:
        last = widths[-1]
        grow = WIDTH_STEP if last < LINEAR_WIDTH_BUCKETS * WIDTH_STEP else -(-last // 8 // WIDTH_STEP) * WIDTH_STEP
        widths.append(last + grow)
    return [min(w, cache_len) for w in widths]


def width_bucket(slots: int, cache_len: int) -> int:
    """The attention width that covers ``slots`` slots: the smallest of ``width_buckets``."""
    return next(w for w in width_buckets(cache_len) if w >= min(slots, cache_len))


def reachable_buckets(max_rows: int, cache_len: int) -> List[Bucket]:
    """Every (rows, width) bucket an engine of ``max_rows`` rows and ``cache_len`` slots can decode
    in: each row bucket at each width (admission can grow the batch at any offset)."""
    return [(rows, width) for width in width_buckets(cache_len) for rows in row_buckets(max_rows)]


class CaptureFailed(RuntimeError):
    """Capturing a bucket's decode step into a CUDA graph failed; the eager step can run instead."""


class StaticDecoder:
    """Decode steps of static shape over ``context``'s cache, CUDA graphs when ``capture``."""

    def __init__(self, model: torch.nn.Module, context, key_padding: torch.Tensor, capture: bool,
                 routed: Optional[List["GroupedMoELayer"]] = None):
        """``routed``: MoE layers recording their choices (models/routing.py), whose choices each
        step returns beside the logits."""
        self.model = model
        self.routed = routed or []
        self.context = context
        self.key_padding = key_padding  # the generator's [max_batch, cache_len] mask, never reallocated
        self.max_rows, self.cache_len = key_padding.shape
        device = key_padding.device
        self.tokens = torch.zeros(self.max_rows, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(self.max_rows, 1, dtype=torch.long, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.slot_ids = torch.arange(self.cache_len, device=device)
        self.capture = capture
        self._widths = width_buckets(self.cache_len)
        # Per bucket, what runs its step: a CUDA graph's replay (``capture``), else the eager
        # static step. One registry either way, so what gets captured when is the same on a CPU.
        self.graphs: Dict[Bucket, Callable[[], Tuple[torch.Tensor, Optional[torch.Tensor]]]] = {}
        self.captures = 0  # buckets captured (recorded, on a CPU) so far
        self.late_captures = 0  # of which after ``capture_all``: during a run, on the hot path
        self.capture_s = 0.0
        self._started = False  # ``capture_all`` has run
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        # Every graph writes its logits here ([max_rows, V]): one buffer, not one per graph (each
        # [rows, V] of a 152k vocabulary; dozens of buckets would hold gigabytes). The LM head
        # writes into it directly where it can (models/logits_target.py), else a copy does.
        self.logits: Optional[torch.Tensor] = None
        self._head = logits_target(model)
        # Likewise the routed layers' choices, [max_rows, moe layers, top_k].
        self.choices: Optional[torch.Tensor] = None

    def step(self, last: torch.Tensor, offset: int) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The next-token logits [rows, V] of rows whose last tokens are ``last`` ([rows]), written
        to slot ``offset`` (the context's offset, which the caller advances), and with ``routed``
        layers their choices [rows, layers, top_k] (else None). Under graphs both are the graphs'
        buffers: read them before the next step's replay (stream order does, on a GPU)."""
        rows = last.size(0)
        bucket = self.bucket(rows, offset)
        self.tokens[:rows, 0].copy_(last)
        self.slot.fill_(offset)
        self.positions.fill_(offset)
        logits, choices = self._runner(bucket)()
        return logits[:rows], None if choices is None else choices[:rows]

    def bucket(self, rows: int, offset: int) -> Bucket:
        """The bucket a step of ``rows`` live rows writing slot ``offset`` runs in."""
        width = next(w for w in self._widths if w >= offset + 1)
        return row_bucket(rows, self.max_rows), width

    def capture_all(self) -> None:
        """Capture every bucket the engine can reach (``reachable_buckets``), before the first
        step: then no admission or width crossing captures during a run. They write the cache
        slot the step buffers point at (slot 0): call this before the first prefill."""
        for bucket in reachable_buckets(self.max_rows, self.cache_len):
            self._runner(bucket)
        self._started = True

    def _runner(self, bucket: Bucket) -> Callable[[], Tuple[torch.Tensor, Optional[torch.Tensor]]]:
        runner = self.graphs.get(bucket)
        if runner is not None:
            return runner
        start = time.perf_counter()
        if not self.capture:
            runner = functools.partial(self._forward, *bucket)
        else:
            try:
                graph = self._record(*bucket)
            except Exception as exc:  # noqa: BLE001 - e.g. an op that cannot be captured
                raise CaptureFailed(f"capturing the decode step of bucket {bucket} failed: {exc}") from exc
            runner = functools.partial(self._replay, graph)
        self.graphs[bucket] = runner
        self.captures += 1
        self.late_captures += self._started
        self.capture_s += time.perf_counter() - start
        return runner

    def _replay(self, graph: "torch.cuda.CUDAGraph") -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        graph.replay()
        return self.logits, self.choices

    def _forward(self, rows: int, width: int) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        context = self.context
        slots = self.slot_ids[:width]
        # Slots after the new token are masked; the new token's own never is (a row past the live
        # ones may hold any padding, and a row with no slot to see would be NaN in a fused kernel).
        mask = (self.key_padding[:rows, None, None, :width] & (slots != self.slot)) | (slots > self.slot)
        into = (self._head.writing_to(self.logits[:rows]) if self._head is not None and self.logits is not None
                else contextlib.nullcontext())
        with context.static_step(self.slot, width), into:
            logits = self.model(self.tokens[:rows], self.positions[:rows], mask, inference_context=context,
                                runtime_gather_output=True)
        logits = logits[:, -1, :]
        if self.logits is None:
            self.logits = torch.empty(self.max_rows, logits.size(-1), dtype=logits.dtype, device=logits.device)
        if logits.data_ptr() != self.logits.data_ptr():  # the head did not write into the buffer
            self.logits[:rows].copy_(logits)
        choices = None
        if self.routed:  # one token per row: a layer's [rows, top_k] is already row-major
            choices = torch.stack([layer.choices for layer in self.routed], dim=1)
        return self.logits[:rows], choices

    def _record(self, rows: int, width: int) -> "torch.cuda.CUDAGraph":
        """Capture one bucket's step. Warm-up runs first, on a side stream as capture needs (they
        make cuBLAS's workspaces and any lazily built buffers); they rewrite the current slot with
        the same values the replay will write."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                _, warm_choices = self._forward(rows, width)
        torch.cuda.current_stream().wait_stream(side)
        if warm_choices is not None and self.choices is None:
            self.choices = torch.empty((self.max_rows, *warm_choices.shape[1:]), dtype=warm_choices.dtype,
                                       device=warm_choices.device)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the engine captures on its compute thread while a colocated learner may
        # be launching its own work on another.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            _, choices = self._forward(rows, width)  # its logits are in self.logits
            if choices is not None:
                self.choices[:rows].copy_(choices)
        return graph


def static_decode_supported(model: torch.nn.Module) -> bool:
    """Whether the model's decode step has static shapes: the engine's own attention (GQA:
    models/kv_attention.py; multi-latent attention: ``EngineMLASelfAttention`` in models/mla.py,
    in every layer) and, in a mixture of experts, MoE layers that never wait for the host
    (``GroupedMoELayer.without_host_sync``: at one expert- and tensor-parallel rank, grouped
    matmuls that run on the weights' dtype and device, i.e. bf16 on Hopper, any float on a CPU)."""
    from ...models.kv_attention import supports_kv_attention

    config = getattr(model, "config", None)
    if config is None:
        return False
    if config.multi_latent_attention:
        from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

        from ...models.mla import EngineMLASelfAttention, supports_engine_mla

        attention = [m for m in model.modules() if isinstance(m, MultiLatentAttention)]
        if not (supports_engine_mla(config) and attention
                and all(isinstance(m, EngineMLASelfAttention) for m in attention)):
            return False
    elif not supports_kv_attention(config):
        return False
    if not config.num_moe_experts:
        return True
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from ...models.grouped_moe import GroupedMoELayer

    moe = [m for m in model.modules() if isinstance(m, MoELayer)]
    return all(isinstance(m, GroupedMoELayer) and m.without_host_sync() for m in moe)


def make_static_decoder(model: torch.nn.Module, context, key_padding: torch.Tensor, cuda_graphs: bool,
                        eager: bool = False, routed: Optional[List["GroupedMoELayer"]] = None) -> Optional[StaticDecoder]:
    """The static-shape decoder for this model, or None where its step cannot be static (the
    eager step then runs): replaying CUDA graphs on a GPU when ``cuda_graphs``; run eagerly,
    anywhere, when ``eager`` (tests compare it with the eager step). ``routed``: MoE layers whose
    choices each step returns."""
    if not static_decode_supported(model):
        return None
    if eager:
        return StaticDecoder(model, context, key_padding, capture=False, routed=routed)
    if cuda_graphs and key_padding.device.type == "cuda":
        return StaticDecoder(model, context, key_padding, capture=True, routed=routed)
    return None
