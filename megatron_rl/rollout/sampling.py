"""Next-token sampling for the embedded engine: temperature, top-k, top-p; pure tensor functions.

The logprob reported for a sampled token is log softmax(logits / T) over the full vocabulary,
the same quantity the learner computes (``learner/logprobs.py``). Top-k / top-p only restrict
which tokens may be drawn; with them on, the reported logprob is that of the untruncated
tempered distribution, as in verl and vLLM's default ``raw_logprobs`` modes (the importance
ratio then slightly overstates the behaviour probability of low-ranked tokens, which are never
drawn).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set logits outside the top-k and the top-p nucleus to -inf. logits: [b, V] (already tempered)."""
    out = logits
    if top_k and top_k < logits.shape[-1]:
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
                  generator: Optional[torch.Generator] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of logits [b, V]; return (token ids [b], logprobs [b])."""
    tempered = logits.float() / temperature
    logprobs_all = torch.log_softmax(tempered, dim=-1)
    probs = torch.softmax(filter_logits(tempered, top_k, top_p), dim=-1)
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logprobs_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
