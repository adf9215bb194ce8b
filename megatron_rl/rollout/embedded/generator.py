"""Batched, KV-cached decoding with the learner's own Megatron GPTModel.

The KV cache (``EngineKVContext``, a megatron-core ``StaticInferenceContext``) shares one sequence
offset across the batch, so sequences of different lengths are left-padded to a common length and
padded key positions are masked out of attention. RoPE scores depend only on relative positions,
so a row shifted right by its padding computes the same attention as the learner's unpadded
forward (equal up to float rounding; the agreement test bounds it). The forward is the training
forward, so logprobs agree with the learner's.

Continuous batching on top of one shared offset P, two ways:
- ``admit`` (cheap, the usual way): the running rows' cache rows are compacted to the front (a
  copy, nothing recomputed) and the newcomers are prefilled into the rows after them, right-aligned
  to end at P. Keys are rotated by their slot index (models/kv_attention.py rotates them once,
  when written; Megatron's own path, kept for multi-latent attention, when read), so a newcomer's
  tokens at slots P-len..P-1 see the same relative positions as in an unpadded forward.
  It needs len <= P and P + the newcomer's budget <= the cache length.
- ``prefill`` (a rebuild): any set of sequences (prompts, or prompts plus the tokens generated so
  far) from slot 0. The engine uses it to start, when the offset has run too far to admit anyone,
  and after new weights (the old weights' cache is recomputed, not reused).
Rows aligned at their ends need ``longest sequence + largest remaining budget`` slots, so the cache
is twice the model's context by default. Both prefill equal sequences once (a GRPO group's
samples share their prompt) and copy the cache entries to the other rows.

Mixture-of-experts models record routing (``record_routing``, on by default for them): every call
also returns, per row, the experts each MoE layer chose for the positions that call computed for
the row (``Sampled.routing``), copied to the host with the sampled tokens. A prefill or admission
computes each sequence's positions (a duplicate gets its twin's), a decode step one position per
row: the row's last token, fed back.

Rows may carry random streams (``sampling.RowStreams``: a request key and the position of the
row's next draw, given by the caller per sequence): those rows' draws depend on their stream and
logits only. The streams move with the rows wherever the rows move (compaction, admission order).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ...models.causal_attention import causal_mask
from ...types import SamplingParams
from ..sampling import RowStreams, Stream, join_streams, sample_tokens
from .decode_graphs import CaptureFailed

if TYPE_CHECKING:
    from ...models.grouped_moe import GroupedMoELayer

logger = logging.getLogger(__name__)


class Sampled(tuple):
    """``(tokens, logprobs)`` of one model call, one per row, as lists; ``routing``: when routing
    is recorded, per row a [positions, moe layers, top_k] numpy array, the experts each MoE layer
    chose for the positions this call computed for the row (the row's last ones), else None."""

    routing: Optional[Sequence[np.ndarray]]

    def __new__(cls, tokens: List[int], logprobs: List[float], routing: Optional[Sequence[np.ndarray]] = None):
        sampled = super().__new__(cls, (tokens, logprobs))
        sampled.routing = routing
        return sampled


@dataclass
class PrefillRouting:
    """One prefill forward's routing: the choices at each distinct sequence's real positions,
    one sequence after another ([sum(lengths), layers, top_k], on the device), and for each
    sequence the index of its distinct twin (``distinct``)."""

    choices: torch.Tensor
    lengths: List[int]
    source: List[int]

    def per_sequence(self, host: np.ndarray) -> List[np.ndarray]:
        """``choices`` copied to the host, split into each sequence's [length, layers, top_k]."""
        parts = np.split(host, np.cumsum(self.lengths)[:-1])
        return [parts[i] for i in self.source]


def length_groups(sorted_lengths: Sequence[int], max_groups: int = 4) -> List[List[int]]:
    """Split ascending lengths into at most ``max_groups`` runs (indices) where no member is much
    longer than the run's shortest (> 2x + 8 starts a new run): one prefill forward per run pads
    far less than one forward padded to the longest."""
    groups: List[List[int]] = [[]]
    for i, n in enumerate(sorted_lengths):
        group = groups[-1]
        if group and n > 2 * sorted_lengths[group[0]] + 8 and len(groups) < max_groups:
            groups.append([])
        groups[-1].append(i)
    return groups


def distinct(sequences: Sequence[List[int]]) -> Tuple[List[List[int]], List[int]]:
    """The distinct sequences, in first-seen order, and for each sequence the index of its equal
    among them. The samples of a GRPO group share one prompt: it is prefilled once and its cache
    entries copied to the group's other rows (a copy costs far less than a forward)."""
    index: dict = {}
    source = [index.setdefault(tuple(seq), len(index)) for seq in sequences]
    return [list(seq) for seq in index], source


class KVCachedGenerator:
    def __init__(self, model: torch.nn.Module, max_batch_size: int, max_seq_len: int,
                 device: torch.device, seed: int = 0, pad_id: int = 0, cache_len: Optional[int] = None,
                 cuda_graphs: bool = True, static_decode: bool = False, record_routing: bool = True):
        """``cuda_graphs``: on a GPU, replay decode steps from CUDA graphs (decode_graphs.py) where
        the model allows. ``static_decode=True`` runs that static-shape step without graphs (on a
        CPU too; tests compare it with the eager step). ``record_routing``: a mixture of experts'
        calls return their routing (``Sampled.routing``; no effect on a dense model)."""
        from ...models.kv_attention import EngineKVContext
        from .decode_graphs import make_static_decoder

        self.model = model
        self.device = device
        self.max_batch_size = max_batch_size
        # Longest sequence (prompt + response) a request may reach: the model's context.
        self.max_seq_len = max_seq_len
        self.cache_len = cache_len or 2 * max_seq_len
        self.pad_id = pad_id
        config = getattr(model, "config", None)
        self.context = EngineKVContext(max_batch_size, self.cache_len, config)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.rows = 0
        # [max_batch, cache_len] True where masked; one tensor for the engine's life (graphs read it).
        self._key_padding = torch.zeros(max_batch_size, self.cache_len, dtype=torch.bool, device=device)
        self._last: Optional[torch.Tensor] = None  # [rows] last sampled tokens
        self._streams: Optional[RowStreams] = None  # the rows' random streams; None: no row has one
        self.slides = 0  # times the window moved left (_slide_window)
        # The first cache slot any row uses, while the rows stay as they are (None: to be read
        # from the device, once; decode steps do not move it).
        self._first_used: Optional[int] = None
        # Megatron's multi-latent attention rotates keys before caching them, in a layout of its
        # own: its entries cannot be moved to other slots, so its window never slides (it grows
        # with the batch's age until a rebuild).
        self._can_slide = not getattr(config, "multi_latent_attention", False)
        self._routed = self._routed_layers(model) if record_routing else []
        self._static = make_static_decoder(model, self.context, self._key_padding, cuda_graphs, eager=static_decode,
                                           routed=self._routed)

    @staticmethod
    def _routed_layers(model: torch.nn.Module) -> List["GroupedMoELayer"]:
        """The model's MoE layers, set to keep their choices, when all of them can (the device
        path, models/grouped_moe.py); none for a dense model."""
        from ...models.routing import moe_layers, record_routing

        layers = moe_layers(model)
        if not layers or not all(layer.on_device_path() for layer in layers):
            if getattr(getattr(model, "config", None), "num_moe_experts", None):
                logger.warning("this mixture of experts cannot record its routing in the engine "
                               "(MoE layers off the grouped device path)")
            return []
        record_routing(model)
        return layers

    @property
    def records_routing(self) -> bool:
        return bool(self._routed)

    @torch.no_grad()
    def capture_decode_buckets(self) -> None:
        """Capture every decode bucket the engine can reach (decode_graphs.py), so that no step of
        a run captures one; before the first prefill (the captures write cache slot 0). Without a
        static decoder (an eager model, or a CPU without ``static_decode``) nothing to do."""
        if self._static is None:
            return
        try:
            self._static.capture_all()
        except CaptureFailed as exc:
            logger.warning("%s; decoding without CUDA graphs", exc)
            self._static = None

    @property
    def captures(self) -> Tuple[int, int, float]:
        """Decode buckets captured so far, how many of them during a run (after
        ``capture_decode_buckets``), and the seconds all captures took."""
        static = self._static
        return (0, 0, 0.0) if static is None else (static.captures, static.late_captures, static.capture_s)

    def check_request(self, prompt_len: int, max_new_tokens: int) -> None:
        if prompt_len + max_new_tokens > self.max_seq_len:
            raise ValueError(f"prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} exceeds "
                             f"the {self.max_seq_len} tokens an engine row holds (rollout.max_model_len, "
                             f"by default data.max_prompt_tokens + rollout.max_new_tokens)")

    def fits(self, lengths: Sequence[int], remaining: Sequence[int]) -> bool:
        """Whether rows of these current lengths and remaining token budgets share one rebuilt cache."""
        return len(lengths) <= self.max_batch_size and max(lengths) + max(remaining) <= self.cache_len

    @property
    def offset(self) -> int:
        return self.context.sequence_len_offset

    def can_admit(self, running: int, length: int, remaining: int) -> bool:
        """Whether a sequence can join ``running`` rows at the current offset without a rebuild."""
        return (running + 1 <= self.max_batch_size and length <= self.offset
                and self.offset + remaining <= self.cache_len)

    def _left_pad(self, sequences: List[List[int]], width: int, end: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Tokens [m, width], each sequence right-aligned, and key padding [m, cache_len]: True at
        the cache slots before each sequence when the rows end at slot ``end``."""
        # Filled in numpy, then one copy each: a torch.tensor per row took ~25 ms at 256 prompts
        # of 512 tokens, time the GPU waits for before a prefill.
        tokens = np.full((len(sequences), width), self.pad_id, dtype=np.int64)
        padding = np.zeros((len(sequences), self.cache_len), dtype=np.bool_)
        for row, seq in enumerate(sequences):
            tokens[row, width - len(seq) :] = seq
            padding[row, : end - len(seq)] = True
        return torch.from_numpy(tokens).to(self.device), torch.from_numpy(padding).to(self.device)

    def _logits(self, tokens: torch.Tensor, start: int, mask: Optional[torch.Tensor]) -> torch.Tensor:
        b, s = tokens.shape
        positions = torch.arange(start, start + s, device=self.device).unsqueeze(0).expand(b, s)
        logits = self.model(tokens, positions, mask, inference_context=self.context,
                            runtime_gather_output=True)
        return logits[:, -1, :]

    @torch.no_grad()
    def prefill(self, sequences: List[List[int]], params: SamplingParams,
                streams: Optional[Sequence[Optional[Stream]]] = None) -> Sampled:
        """Start a new batch from these (left-padded) sequences; sample each row's next token.
        ``streams``: per sequence, (request key, position of its next token) or None."""
        width = max(len(s) for s in sequences)
        if len(sequences) > self.max_batch_size:
            raise ValueError(f"batch of {len(sequences)} exceeds rollout.max_batch_size={self.max_batch_size}")
        self.context.reset()
        self._first_used = None
        self.rows = len(sequences)
        unique, source = distinct(sequences)
        tokens, padding = self._left_pad(unique, width, end=width)
        self._key_padding.zero_()
        self._key_padding[: len(unique)] = padding
        # Sequences of one length need no padding mask: None is the plain causal mask, which the
        # GPU's flash kernel computes without reading a mask (kv_attention.py).
        uniform = all(len(seq) == width for seq in unique)
        mask = None
        if not uniform:
            mask = causal_mask(width, self.device) | self._key_padding[: len(unique), None, None, :width]
        logits = self._logits(tokens, 0, mask)
        routing = self._prefill_routing(width, unique, source)
        self.context.sequence_len_offset += width
        self.context.enable_decode_mode()
        self._streams = RowStreams.build(streams, len(sequences), self.device)
        sampled = self._sample(self._copy_duplicates(0, logits, source), params)
        if routing is None:
            return to_host(*sampled)
        tokens_and_logprobs = to_host(*sampled, routing.choices)
        return Sampled(*tokens_and_logprobs, routing.per_sequence(tokens_and_logprobs.routing))

    def _prefill_routing(self, width: int, unique: List[List[int]], source: List[int]) -> Optional[PrefillRouting]:
        """The routing of the forward just run over ``unique`` right-aligned in ``width`` columns,
        at their real positions (None when routing is not recorded)."""
        if not self._routed:
            return None
        b = len(unique)
        # Each layer's [s·b, top_k] is sequence-major: as [b, s, layers, top_k], rows one after another.
        choices = torch.stack([layer.choices for layer in self._routed], dim=1)
        choices = choices.view(width, b, *choices.shape[1:]).transpose(0, 1)
        lengths = [len(seq) for seq in unique]
        starts = width - torch.tensor(lengths, device=choices.device)
        real = torch.arange(width, device=choices.device)[None, :] >= starts[:, None]
        return PrefillRouting(choices[real], lengths, source)

    @torch.no_grad()
    def admit(self, keep: List[int], sequences: List[List[int]], params: SamplingParams,
              streams: Optional[Sequence[Optional[Stream]]] = None) -> Sampled:
        """Keep rows ``keep`` (moved to the front, in that order), add ``sequences`` after them at the
        current offset, and sample the newcomers' next tokens (only theirs are returned, in order).
        ``streams``: the newcomers' random streams, as for ``prefill``.

        Newcomers are prefilled in groups of similar length (one forward each), so a few long
        prompts do not pad every newcomer to their length."""
        offset, n, m = self.offset, len(keep), len(sequences)
        self._first_used = None
        if n + m > self.max_batch_size:
            raise ValueError(f"batch of {n + m} exceeds rollout.max_batch_size={self.max_batch_size}")
        if keep != list(range(n)):
            idx = torch.tensor(keep, device=self.device)
            self.context.copy_rows(0, idx, offset)
            self._key_padding[:n] = self._key_padding[idx]
            self._last = self._last[idx]
        self.rows = n + m
        self._last = self._last[:n]
        self._streams = self._streams.select(keep) if self._streams is not None else None
        if not m:
            return Sampled([], [])
        if max(len(seq) for seq in sequences) > offset:
            raise ValueError(f"a sequence of {max(len(seq) for seq in sequences)} tokens cannot join at offset {offset}")
        order = sorted(range(m), key=lambda i: len(sequences[i]))
        new = torch.empty(m, dtype=torch.long, device=self.device)
        logprobs = torch.empty(m, dtype=torch.float, device=self.device)
        incoming = RowStreams.build(streams, m, self.device)
        row = n
        routed: List[Tuple[List[int], PrefillRouting]] = []
        for group in length_groups([len(sequences[i]) for i in order]):
            members = [order[i] for i in group]
            group_streams = incoming.select(members) if incoming is not None else None
            sampled, lps, routing = self._prefill_rows(row, [sequences[i] for i in members], params, group_streams)
            new[members], logprobs[members] = sampled, lps
            if routing is not None:
                routed.append((members, routing))
            row += len(members)
        # The groups filled the rows in length order; put them in the caller's order.
        if order != sorted(order):
            rank = torch.empty(m, dtype=torch.long)
            rank[torch.tensor(order)] = torch.arange(m)
            self._move_rows(n, rank.to(self.device) + n)
        self._last = torch.cat([self._last, new])
        self._streams = join_streams(self._streams, n, incoming.advanced() if incoming is not None else None, m)
        if not routed:
            return to_host(new, logprobs)
        host = to_host(new, logprobs, torch.cat([routing.choices for _, routing in routed]))
        return Sampled(*host, admitted_routing(host.routing, routed, m))

    def _move_rows(self, first: int, source: torch.Tensor) -> None:
        """Rows first.. become copies of rows ``source`` (cache entries and key padding)."""
        self.context.copy_rows(first, source, self.offset)
        self._key_padding[first : first + len(source)] = self._key_padding[source]

    def _prefill_rows(self, first_row: int, sequences: List[List[int]], params: SamplingParams,
                      streams: Optional[RowStreams]) -> Tuple[torch.Tensor, torch.Tensor, Optional[PrefillRouting]]:
        """Prefill ``sequences`` into rows ``first_row``.. so that they end at the current offset;
        sample their next tokens (``streams``: theirs, in that order); their routing when recorded."""
        offset = self.offset
        width = max(len(seq) for seq in sequences)
        start = offset - width
        unique, source = distinct(sequences)
        tokens, padding = self._left_pad(unique, width, end=offset)
        rows = slice(first_row, first_row + len(unique))
        self._key_padding[rows] = padding
        # Slots before the newcomers hold earlier rows' entries (or uninitialised memory).
        self.context.clear_slots(rows, start)
        causal = torch.ones(width, offset, dtype=torch.bool, device=self.device).triu(start + 1)
        mask = causal[None, None] | self._key_padding[rows, None, None, :offset]
        self.context.sequence_len_offset, self.context.batch_size_offset = start, first_row
        try:
            logits = self._logits(tokens, start, mask)
        finally:
            self.context.sequence_len_offset, self.context.batch_size_offset = offset, 0
        routing = self._prefill_routing(width, unique, source)
        logits = self._copy_duplicates(first_row, logits, source)
        return (*sample_tokens(logits, params.temperature, params.top_k, params.top_p, self.generator, streams),
                routing)

    def _copy_duplicates(self, first_row: int, logits: torch.Tensor, source: List[int]) -> torch.Tensor:
        """The distinct sequences were prefilled into rows first_row..; give every sequence its row
        (row first_row + i holds sequence i: cache entries and key padding copied from its
        distinct twin) and its next-token logits ([distinct, V] -> [sequences, V])."""
        if len(source) == logits.size(0):
            return logits
        index = torch.tensor(source, device=self.device)
        self._move_rows(first_row, index + first_row)
        return logits[index]

    def decode(self, params: SamplingParams) -> Sampled:
        """One decode step for every row of the batch (the caller ignores rows it has finished)."""
        return self.decode_start(params).result()

    @torch.no_grad()
    def decode_start(self, params: SamplingParams) -> "PendingStep":
        """Launch one decode step; its tokens come from the returned step's ``result()``. On a GPU
        this returns before the step has run, so the next step can be launched before this one's
        tokens are read (the host's bookkeeping then overlaps the device's work)."""
        self._slide_window()
        position = self.context.sequence_len_offset
        if position >= self.cache_len:
            raise RuntimeError(f"KV cache of {self.cache_len} slots is full")
        logits = choices = None
        if self._static is not None:
            try:
                logits, choices = self._static.step(self._last, position)
            except CaptureFailed as exc:
                # Its warm-up wrote this step's cache slot; the eager step rewrites the same values.
                logger.warning("%s; decoding without CUDA graphs from now on", exc)
                self._static = None
        if logits is None:
            mask = self._key_padding[: self.rows, None, None, : position + 1]
            logits = self._logits(self._last.unsqueeze(1), position, mask)
            if self._routed:  # one token per row: each layer's [rows, top_k] is row-major
                choices = torch.stack([layer.choices for layer in self._routed], dim=1)
        self.context.sequence_len_offset += 1
        # One position per row: [rows, 1, layers, top_k].
        return PendingStep(*self._sample(logits, params), None if choices is None else choices.unsqueeze(1))

    def _slide_window(self) -> None:
        """Move every row's entries left by the slots that no row uses any more.

        Continuous admission keeps advancing the shared offset, and each decode step attends over
        every slot up to it, so without this the cost per token grows with the batch's age, not
        with its sequences' lengths. All rows move together and keys stored rotated are rotated
        back by the shift, so relative positions (and attention) are unchanged. The offset is kept at
        least half the model's context, so typical newcomers still fit in place."""
        offset = self.offset
        floor = self.max_seq_len // 2
        if offset <= floor or not self.rows or not self._can_slide:
            return
        padding = self._key_padding[: self.rows, :offset]
        if self._first_used is None:
            # Rows are right-aligned: their padding is a prefix; argmax finds each row's first real slot.
            self._first_used = int((~padding).to(torch.uint8).argmax(dim=1).min())
        shift = min(self._first_used, offset - floor)
        if shift < max(16, offset // 4):  # not worth a copy of the cache
            return
        kept = offset - shift
        self.context.shift_left(shift, offset, self.rows, self._unrotation(shift))
        self._key_padding[: self.rows, :kept] = padding[:, shift:].clone()
        self._key_padding[: self.rows, kept:] = False
        self.context.sequence_len_offset = kept
        self._first_used -= shift
        self.slides += 1

    def _unrotation(self, shift: int) -> Optional[torch.Tensor]:
        """RoPE frequencies that rotate a key back by ``shift`` positions ([1, 1, 1, dim]; None
        without RoPE). Positions enter RoPE linearly: the frequencies of -shift undo +shift."""
        rotary = getattr(self.model, "rotary_pos_emb", None)
        return None if rotary is None else -rotary(1, offset=shift)

    def _sample(self, logits: torch.Tensor, params: SamplingParams) -> Tuple[torch.Tensor, torch.Tensor]:
        """Every row's next token and its logprob, each keyed row from its stream (which then
        moves on a position)."""
        new, logprobs = sample_tokens(logits, params.temperature, params.top_k, params.top_p, self.generator,
                                      self._streams)
        self._last = new
        if self._streams is not None:
            self._streams = self._streams.advanced()
        return new, logprobs


class PendingStep:
    """A step's sampled tokens and logprobs (and routing, when recorded), copied to the host
    without waiting; ``result()`` waits (once, for all) and returns them as lists (the routing
    as a numpy array). The copies are queued right behind the step, so a step launched after
    this one (look-ahead) cannot overwrite a graph's routing buffer before it is copied."""

    def __init__(self, tokens: torch.Tensor, logprobs: torch.Tensor, routing: Optional[torch.Tensor] = None):
        self._ready = None
        if tokens.is_cuda:  # into pinned host memory, behind the step's kernels
            tokens, logprobs = tokens.to("cpu", non_blocking=True), logprobs.to("cpu", non_blocking=True)
            if routing is not None:
                routing = routing.to("cpu", non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        self._tokens, self._logprobs, self._routing = tokens, logprobs, routing

    def result(self) -> Sampled:
        if self._ready is not None:
            self._ready.synchronize()
        # A copy: rows' records outlive the step, and pinned buffers should go back to their pool.
        routing = None if self._routing is None else np.array(self._routing.numpy())
        return Sampled(self._tokens.tolist(), self._logprobs.tolist(), routing)


def to_host(tokens: torch.Tensor, logprobs: torch.Tensor, routing: Optional[torch.Tensor] = None) -> Sampled:
    """All as host values after one wait for the device (two ``.tolist()`` calls wait twice)."""
    return PendingStep(tokens, logprobs, routing).result()


def admitted_routing(host: np.ndarray, routed: List[Tuple[List[int], PrefillRouting]], m: int) -> List[np.ndarray]:
    """Each of ``m`` newcomers' routing, in the caller's order, from the length groups' routing
    (``routed``: each group's members and its routing, in group order) copied to the host as one
    array."""
    out: List[Optional[np.ndarray]] = [None] * m
    first = 0
    for members, routing in routed:
        size = sum(routing.lengths)
        for member, part in zip(members, routing.per_sequence(host[first : first + size])):
            out[member] = part
        first += size
    return out
