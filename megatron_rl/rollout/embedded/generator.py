"""Batched, KV-cached decoding with the learner's own Megatron GPTModel.

megatron-core's ``StaticInferenceContext`` holds the KV cache and shares one sequence offset
across the batch, so prompts of different lengths are left-padded to a common length and padded
key positions are masked out of attention. RoPE scores depend only on relative positions, so a
row shifted right by its padding computes the same attention as the learner's unpadded forward
(equal up to float rounding; the agreement test bounds it). The forward is the training forward,
so logprobs agree with the learner's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch

from ...learner.learner import causal_mask
from ...types import SamplingParams
from ..sampling import sample_tokens


@dataclass
class BatchState:
    """Decoding state of one batch of requests sharing sampling params."""

    request_ids: List[str]
    params: SamplingParams
    tokens: List[List[int]] = field(default_factory=list)
    logprobs: List[List[float]] = field(default_factory=list)
    finished: List[Optional[str]] = field(default_factory=list)
    last: Optional[torch.Tensor] = None        # [b] last sampled tokens, input of the next step
    key_padding: Optional[torch.Tensor] = None  # [b, max_seq] True at left-padding slots

    def __post_init__(self) -> None:
        n = len(self.request_ids)
        self.tokens = [[] for _ in range(n)]
        self.logprobs = [[] for _ in range(n)]
        self.finished = [None] * n

    @property
    def done(self) -> bool:
        return all(f is not None for f in self.finished)


class KVCachedGenerator:
    def __init__(self, model: torch.nn.Module, max_batch_size: int, max_seq_len: int,
                 device: torch.device, seed: int = 0, pad_id: int = 0):
        from megatron.core.inference.contexts import StaticInferenceContext

        self.model = model
        self.device = device
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.pad_id = pad_id
        self.context = StaticInferenceContext(max_batch_size, max_seq_len)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def _logits(self, tokens: torch.Tensor, start: int, mask: torch.Tensor) -> torch.Tensor:
        b, s = tokens.shape
        positions = torch.arange(start, start + s, device=self.device).unsqueeze(0).expand(b, s)
        logits = self.model(tokens, positions, mask, inference_context=self.context,
                            runtime_gather_output=True)
        return logits[:, -1, :]

    @torch.no_grad()
    def start(self, state: BatchState, prompts: List[List[int]]) -> None:
        """Prefill the (left-padded) prompts and sample each row's first token."""
        width = max(len(p) for p in prompts)
        if len(prompts) > self.max_batch_size:
            raise ValueError(f"batch of {len(prompts)} exceeds rollout.max_batch_size={self.max_batch_size}")
        if width + state.params.max_new_tokens > self.max_seq_len:
            raise ValueError(
                f"prompt of {width} tokens + max_new_tokens={state.params.max_new_tokens} "
                f"exceeds the model's max_position_embeddings={self.max_seq_len}"
            )
        self.context.reset()
        tokens = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        padding = torch.zeros(len(prompts), self.max_seq_len, dtype=torch.bool)
        for row, prompt in enumerate(prompts):
            tokens[row, width - len(prompt) :] = torch.tensor(prompt)
            padding[row, : width - len(prompt)] = True
        state.key_padding = padding.to(self.device)
        mask = causal_mask(width, self.device) | state.key_padding[:, None, None, :width]
        logits = self._logits(tokens.to(self.device), 0, mask)
        self.context.sequence_len_offset += width
        self.context.enable_decode_mode()
        self._sample(state, logits)

    @torch.no_grad()
    def step(self, state: BatchState) -> None:
        """One decode step for every row (finished rows are computed but ignored)."""
        position = self.context.sequence_len_offset
        mask = state.key_padding[:, None, None, : position + 1]
        logits = self._logits(state.last.unsqueeze(1), position, mask)
        self.context.sequence_len_offset += 1
        self._sample(state, logits)

    def _sample(self, state: BatchState, logits: torch.Tensor) -> None:
        p = state.params
        new, logprobs = sample_tokens(logits, p.temperature, p.top_k, p.top_p, self.generator)
        state.last = new
        for row, (tok, lp) in enumerate(zip(new.tolist(), logprobs.tolist())):
            if state.finished[row] is not None:
                continue
            state.tokens[row].append(tok)
            state.logprobs[row].append(lp)
            if tok in p.stop_token_ids:
                state.finished[row] = "stop"
            elif len(state.tokens[row]) >= p.max_new_tokens:
                state.finished[row] = "length"
