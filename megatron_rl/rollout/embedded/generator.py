"""Batched, KV-cached decoding with the learner's own Megatron GPTModel.

megatron-core's ``StaticInferenceContext`` holds the KV cache; one sequence offset is shared by the
whole batch, so a batch holds prompts of equal length (the engine buckets requests by length).
The forward is the training forward, so logprobs agree with the learner's.
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
    """Decoding state of one batch of equal-length prompts."""

    request_ids: List[str]
    params: SamplingParams
    prompt_len: int
    tokens: List[List[int]] = field(default_factory=list)
    logprobs: List[List[float]] = field(default_factory=list)
    finished: List[Optional[str]] = field(default_factory=list)
    last: Optional[torch.Tensor] = None  # [b] last sampled tokens, input of the next decode step

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
                 device: torch.device, seed: int = 0):
        from megatron.core.inference.contexts import StaticInferenceContext

        self.model = model
        self.device = device
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.context = StaticInferenceContext(max_batch_size, max_seq_len)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def _logits(self, tokens: torch.Tensor, start: int, mask: Optional[torch.Tensor]) -> torch.Tensor:
        b, s = tokens.shape
        positions = torch.arange(start, start + s, device=self.device).unsqueeze(0).expand(b, s)
        logits = self.model(tokens, positions, mask, inference_context=self.context,
                            runtime_gather_output=True)
        return logits[:, -1, :]

    @torch.no_grad()
    def start(self, state: BatchState, prompts: List[List[int]]) -> None:
        """Prefill the prompts and sample each row's first token."""
        if len(prompts) > self.max_batch_size:
            raise ValueError(f"batch of {len(prompts)} exceeds rollout.max_batch_size={self.max_batch_size}")
        if state.prompt_len + state.params.max_new_tokens > self.max_seq_len:
            raise ValueError(
                f"prompt of {state.prompt_len} tokens + max_new_tokens={state.params.max_new_tokens} "
                f"exceeds the model's max_position_embeddings={self.max_seq_len}"
            )
        self.context.reset()
        tokens = torch.tensor(prompts, dtype=torch.long, device=self.device)
        logits = self._logits(tokens, 0, causal_mask(state.prompt_len, self.device))
        self.context.sequence_len_offset += state.prompt_len
        self.context.enable_decode_mode()
        self._sample(state, logits)

    @torch.no_grad()
    def step(self, state: BatchState) -> None:
        """One decode step for every row (finished rows are computed but ignored)."""
        position = self.context.sequence_len_offset
        logits = self._logits(state.last.unsqueeze(1), position, None)
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
