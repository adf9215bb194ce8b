"""Next-token sampling for the embedded engine: temperature, top-k, top-p; pure tensor functions.

The logprob reported for a sampled token is log softmax(logits / T) over the full vocabulary,
the same quantity the learner computes (``learner/logprobs.py``). Top-k / top-p only restrict
which tokens may be drawn; with them on, the reported logprob is that of the untruncated
tempered distribution, as in verl and vLLM's default ``raw_logprobs`` modes (the importance
ratio then slightly overstates the behaviour probability of low-ranked tokens, which are never
drawn).

Per-request random streams: a request with ``SamplingParams.seed`` draws from a stream keyed by
(seed, request id), so its tokens depend only on that key, its token position and its logits, not
on which rows share its batch or which engine serves it. The draw is Gumbel-max over counter-based
noise: a hash of (key, position, vocab id) gives one uniform per vocab entry, and
argmax(filtered logits + Gumbel noise) is an exact sample of softmax(filtered logits). Rows without
a stream draw from the engine's ``torch.Generator``.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from ..compiled import CompiledOrEager
from . import sampling_kernel

# (request key, position): the stream of one row's next draw.
Stream = Tuple[int, int]

_MASK32 = 0xFFFFFFFF
# Uniforms carry 23 bits: (m + 0.5) / 2**23 is exact in float32 and strictly inside (0, 1), so
# -log(-log(u)) is always finite.
_UNIFORM_BITS = 23
# Vocab entries per block of rows in a keyed draw. On a CPU a block's int64 words (2 MiB) stay in
# a core's L2 cache (measured about 2x faster than one pass over [256, 32000]); on a GPU blocks only
# bound the transient memory (three [block] buffers).
_CPU_BLOCK = 1 << 18
_GPU_BLOCK = 1 << 24


def _cuts_top_k(top_k: int, vocab: int) -> bool:
    """Whether a top-k of ``top_k`` removes any of ``vocab`` tokens (0: no top-k)."""
    return bool(top_k) and top_k < vocab


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set logits outside the top-k and the top-p nucleus to -inf. logits: [b, V] (already tempered)."""
    out = logits
    if _cuts_top_k(top_k, logits.shape[-1]):
        kth = torch.topk(out, top_k, dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep a token while the mass strictly before it is < top_p (the top token always stays).
        before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def sample_tokens(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                  generator: Optional[torch.Generator] = None,
                  streams: Optional["RowStreams"] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of logits [b, V]; return (token ids [b], logprobs [b]). Rows with a
    stream (``streams``) draw from it, the others from ``generator``."""
    if streams is None and not _cuts_top_k(top_k, logits.shape[-1]) and top_p >= 1.0:
        # The common case (no filter, no per-request streams): on a GPU one Triton kernel reads
        # the raw logits once; elsewhere one compiled pass over them and the generator's noise.
        if sampling_kernel.available(logits):
            return sampling_kernel.sample(logits, temperature, sampling_kernel.draw_seed(generator, logits.device))
        return draw_tempered(logits, exponential_noise(logits, generator), temperature)
    tempered = logits.float() / temperature
    logprobs_all = torch.log_softmax(tempered, dim=-1)
    filtered = filter_logits(tempered, top_k, top_p)
    if streams is None or not any(streams.keyed):
        tokens = _multinomial(filtered, generator)
    elif all(streams.keyed):
        tokens = keyed_choice(filtered, streams.keys, streams.positions)
    else:
        keyed = torch.tensor(streams.keyed, device=filtered.device)
        tokens = torch.empty(filtered.shape[0], dtype=torch.long, device=filtered.device)
        tokens[keyed] = keyed_choice(filtered[keyed], streams.keys[keyed], streams.positions[keyed])
        tokens[~keyed] = _multinomial(filtered[~keyed], generator)
    return tokens, logprobs_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _multinomial(filtered: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    return torch.multinomial(torch.softmax(filtered, dim=-1), 1, generator=generator).squeeze(-1)


def exponential_noise(logits: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    """One Exp(1) draw per logit (fp32), from ``generator``: the noise ``torch.multinomial`` draws
    for one sample, in the same order, so ``draw_tempered`` picks the token it would pick."""
    return torch.empty(logits.shape, dtype=torch.float32, device=logits.device).exponential_(generator=generator)


def _draw_tempered(logits: torch.Tensor, noise: torch.Tensor, temperature: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Token argmax(softmax(logits / T) / noise) per row (the exponential race ``torch.multinomial``
    runs for one sample: an exact draw from the softmax) and its logprob under softmax(logits / T)."""
    tempered = logits.float() / temperature
    lse = torch.logsumexp(tempered, dim=-1, keepdim=True)
    tokens = ((tempered - lse).exp() / noise).argmax(dim=-1, keepdim=True)
    return tokens.squeeze(-1), (tempered.gather(-1, tokens) - lse).squeeze(-1)


# Unfused, a decode step's sampling at batch 256 and a 152k vocabulary ran about 15 kernels over
# [256, V] fp32 copies (cast, divide, log-softmax, softmax, the noise, its division, argmax,
# multinomial's checks): 0.9 ms of a 6 ms step on an H200. Compiled on a GPU: a couple of kernels.
draw_tempered = CompiledOrEager(_draw_tempered, "sampling")


def request_key(seed: int, request_id: str) -> int:
    """The 64-bit key of a request's stream, as a signed int (it lives in an int64 tensor).
    blake2b, not Python's ``hash``: the key must be the same in every process and run."""
    digest = hashlib.blake2b(f"{seed}:{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _mix32(x: torch.Tensor, scratch: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A bijective 32-bit finalizer on int64 tensors holding values in [0, 2**32), in place
    (``scratch``: a buffer like ``x``, so the shifts of a big block allocate nothing).
    The splitmix32 constants are both below 2**31, so every product stays below 2**63 (no signed
    overflow); masking keeps the low 32 bits, i.e. the product mod 2**32."""
    scratch = torch.empty_like(x) if scratch is None else scratch
    for shift, multiplier in ((16, 0x21F0AAAD), (15, 0x735A2D97)):
        x ^= torch.bitwise_right_shift(x, shift, out=scratch)
        x *= multiplier
        x &= _MASK32
    x ^= torch.bitwise_right_shift(x, 15, out=scratch)
    return x


@functools.lru_cache(maxsize=8)
def _vocab_words(vocab_size: int, device: torch.device) -> torch.Tensor:
    """One hashed 32-bit word per vocab id ([V] int64), shared by every row and step."""
    return _mix32(torch.arange(vocab_size, dtype=torch.int64, device=device))


def _row_words(keys: torch.Tensor, positions: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Two 32-bit words per row from (64-bit key, position): together a 64-bit row state, so two
    distinct draws share their noise only by a 2**-64 chance. Each chain step is a bijection of
    its input, so one key never repeats a word at two positions below 2**32."""
    lo, hi = keys & _MASK32, (keys >> 32) & _MASK32
    t = positions & _MASK32
    first = _mix32(lo ^ _mix32(hi ^ _mix32(t.clone())))
    second = _mix32(hi ^ _mix32(lo ^ _mix32((t + 0x9E3779B9) & _MASK32)))
    return first, second


def stream_noise(keys: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [b, V] (float32), a pure function of each row's (key, position) and the
    vocab id: the same draw whatever the batch, row order or engine."""
    first, second = _row_words(keys, positions)
    x = _vocab_words(vocab_size, keys.device)[None, :] ^ first[:, None]
    x += second[:, None]
    x &= _MASK32
    scratch = torch.empty_like(x)
    _mix32(x, scratch)
    torch.bitwise_right_shift(x, 32 - _UNIFORM_BITS, out=scratch)
    u = scratch.to(torch.float32).add_(0.5).mul_(2.0 ** -_UNIFORM_BITS)
    return u.log_().neg_().log_().neg_()


def keyed_choice(filtered: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Gumbel-max: argmax(filtered + noise) is distributed as softmax(filtered) per row ([b] ids).
    Computed in blocks of rows (see ``_CPU_BLOCK``); each row's noise is its own either way."""
    b, vocab = filtered.shape
    block = _CPU_BLOCK if filtered.device.type == "cpu" else _GPU_BLOCK
    rows = max(1, block // vocab)
    if rows >= b:
        return stream_noise(keys, positions, vocab).add_(filtered).argmax(dim=-1)
    tokens = torch.empty(b, dtype=torch.long, device=filtered.device)
    for start in range(0, b, rows):
        part = slice(start, start + rows)
        tokens[part] = stream_noise(keys[part], positions[part], vocab).add_(filtered[part]).argmax(dim=-1)
    return tokens


@dataclass(frozen=True)
class RowStreams:
    """The random streams of a batch's rows. ``keyed`` is kept as Python bools, so choosing the
    sampling path needs no device sync."""

    keys: torch.Tensor       # [b] int64; 0 on rows without a stream
    positions: torch.Tensor  # [b] int64: tokens the row's request generated before this draw
    keyed: Tuple[bool, ...]  # per row: whether it has a stream

    @staticmethod
    def build(streams: Optional[Sequence[Optional[Stream]]], rows: int,
              device: torch.device) -> Optional["RowStreams"]:
        """From one (key, position) or None per row; None when no row has a stream."""
        if streams is not None and len(streams) != rows:
            raise ValueError(f"{len(streams)} streams for {rows} rows")
        if streams is None or all(s is None for s in streams):
            return None
        keys = torch.tensor([0 if s is None else s[0] for s in streams], dtype=torch.int64)
        positions = torch.tensor([0 if s is None else s[1] for s in streams], dtype=torch.int64)
        return RowStreams(keys.to(device), positions.to(device), tuple(s is not None for s in streams))

    @staticmethod
    def none(rows: int, device: torch.device) -> "RowStreams":
        empty = torch.zeros(rows, dtype=torch.int64, device=device)
        return RowStreams(empty, empty.clone(), (False,) * rows)

    def select(self, rows: Sequence[int]) -> Optional["RowStreams"]:
        """These rows, in this order (None if none of them has a stream)."""
        keyed = tuple(self.keyed[r] for r in rows)
        if not any(keyed):
            return None
        index = torch.tensor(list(rows), dtype=torch.long, device=self.keys.device)
        return RowStreams(self.keys[index], self.positions[index], keyed)

    def advanced(self) -> "RowStreams":
        """After a draw: every row's next draw is one position on."""
        return RowStreams(self.keys, self.positions + 1, self.keyed)


def join_streams(first: Optional[RowStreams], first_rows: int, second: Optional[RowStreams],
                 second_rows: int) -> Optional[RowStreams]:
    """Rows of ``first`` then rows of ``second`` (either may be None: rows without streams)."""
    if first is None and second is None:
        return None
    device = (first if first is not None else second).keys.device
    first = first if first is not None else RowStreams.none(first_rows, device)
    second = second if second is not None else RowStreams.none(second_rows, device)
    return RowStreams(torch.cat([first.keys, second.keys]), torch.cat([first.positions, second.positions]),
                      first.keyed + second.keyed)
