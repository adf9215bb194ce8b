"""Turn trajectories into micro-batches for the Megatron forward.

Three packings within a token budget (rows × padded length):
- equal shape: every micro-batch is [rows, longest sequence of the batch], so pipeline-parallel
  schedules can use one tensor shape; the rows are spread evenly over as few micro-batches as the
  budget allows, and the last one's few filler rows carry a zero loss mask.
- by length (no pipeline): sequences are sorted by length and cut into runs of similar lengths,
  each padded only to its own longest, so a few long responses do not make every row pay for
  their length. Where the cuts go is chosen to minimise padded tokens plus a fixed cost per
  micro-batch (``split_by_length``): on a long-tailed batch of 256 samples (3.1k tokens) that is
  5 micro-batches and 3.6k padded tokens instead of 2 and 5.6k when cutting only at the token
  budget, an 18 % shorter learner step on a CPU. A batch left in one piece keeps its order.
- one row per GRPO group (``learner.share_prompts``, ``build_shared_micro_batches``): the model
  runs the prompt once and every response after it (models/shared_prefix.py); each sample's own
  row, which the loss reads, is its last prompt token and its response, with the logits gathered
  into it from the group's row.
The loss is a global per-token sum, so the packing does not change what is optimised.

Mixture-of-experts routing replay: a micro-batch whose trajectories carry the engine's routed
experts also carries them laid out for its forward (``MicroBatch.routing``), in the router's token
order, so the learner can hand them to its routers (models/routing.py) right before the forward.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..models.shared_prefix import SegmentLayout, build_segment_layout, take_rows
from ..types import Trajectory
from .train_batch import token_values

# What one more micro-batch costs, in padded tokens (its fixed Python and kernel-launch work),
# when learner.micro_batch_overhead_tokens is not set. Measured: tiny_cpu's model on one CPU
# thread, ~19 us per padded token and ~4 ms per micro-batch; Qwen2-1.5B's shape on one H200, a
# long-tailed batch of 46k tokens trains in 1.37 s at 2048, 1.40 s at 8192 or more, 1.65 s at 512.
MICRO_BATCH_OVERHEAD_TOKENS = {"cpu": 256, "cuda": 4096}

# Per-response-token fields copied from each trajectory, aligned with the label positions.
_TOKEN_FIELDS = ("loss_mask", "advantages", "behav_logprobs", "proximal_logprobs", "ref_logprobs", "values",
                 "returns", "versions")


@dataclass
class MicroBatch:
    tokens: torch.Tensor          # [b, s] input ids (prompt + response, right padded)
    labels: torch.Tensor          # [b, s] next-token targets
    loss_mask: torch.Tensor       # [b, s] 1.0 where labels[b, t] is a trained response token
    advantages: torch.Tensor      # [b, s] per-token advantage (0 outside the mask)
    behav_logprobs: torch.Tensor  # [b, s] logprobs from the rollout engine that sampled the token
    proximal_logprobs: torch.Tensor  # [b, s] the learner's logprobs before the update (behav's until computed)
    ref_logprobs: torch.Tensor    # [b, s] reference-model logprobs (zeros when no reference)
    values: torch.Tensor          # [b, s] critic values before its update (zeros without a critic)
    returns: torch.Tensor         # [b, s] the critic's regression targets (zeros without a critic)
    versions: torch.Tensor        # [b, s] the policy version that sampled each response token
    rows: List[int]               # index of each row in the trajectory list (-1 for filler)
    # With learner.share_prompts: what the model runs instead of ``tokens`` (one row per group);
    # its logits, gathered, are laid out as ``tokens``' would be, so the loss side is unchanged.
    # Then each row is the sample's last prompt token and its response (response_values knows).
    shared: Optional["SharedForward"] = None
    # Routing replay: the engine's recorded experts for every token the model runs (``tokens``, or
    # ``shared.tokens``), [moe_layers, s·b, top_k] in the router's order (see ``routing_tensor``);
    # None when no trajectory of the micro-batch carries routing (dense models, unrecorded runs).
    routing: Optional[torch.Tensor] = None

    def to(self, device: torch.device) -> "MicroBatch":
        moved = {k: (v.to(device) if isinstance(v, (torch.Tensor, SharedForward)) else v)
                 for k, v in self.__dict__.items()}
        return MicroBatch(**moved)

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1]


@dataclass
class SharedForward:
    """One forward row per group: its prompt, then each response (models/shared_prefix.py)."""

    tokens: torch.Tensor      # [groups, s_f] prompt, response 1, ..., response G, right padded
    positions: torch.Tensor   # [groups, s_f] each token's position in its own prompt + response
    layout: SegmentLayout     # which slots attend to which
    logit_index: torch.Tensor  # [rows, s] the flat slot whose logits each place of the rows reads

    def to(self, device: torch.device) -> "SharedForward":
        return SharedForward(self.tokens.to(device), self.positions.to(device), self.layout.to(device),
                             self.logit_index.to(device))

    def gather(self, logits: torch.Tensor) -> torch.Tensor:
        """[groups, s_f, V] logits of the shared forward -> [rows, s, V], each trajectory's."""
        return take_rows(logits.reshape(-1, logits.shape[-1]), self.logit_index)


def build_micro_batches(trajs: Sequence[Trajectory], token_budget: int, pad_id: int = 0,
                        equal_shape: bool = True,
                        overhead_tokens: int = MICRO_BATCH_OVERHEAD_TOKENS["cpu"]) -> List[MicroBatch]:
    """Pack trajectories into micro-batches of at most ``token_budget`` padded tokens (one row at
    least): equal-shape (in order) or, with ``equal_shape=False``, by length (``split_by_length``)."""
    if not trajs:
        return []
    lengths = [len(t.prompt_ids) + len(t.response_ids) for t in trajs]
    seq_len = max(lengths)
    if not equal_shape:
        order = sorted(range(len(trajs)), key=lambda i: lengths[i])
        groups = split_by_length([lengths[i] for i in order], token_budget, overhead_tokens)
        if len(groups) > 1:  # else the batch stays one micro-batch, in its order (below)
            return [_collate(trajs, [order[k] for k in grp], len(grp), lengths[order[grp[-1]]], pad_id)
                    for grp in groups]
    # As few micro-batches as the budget allows, their rows spread evenly: a batch that fits in one
    # is trained at its own size, and the last of several carries fewer than one filler row per
    # micro-batch (pipeline schedules need one shape), not a budget's worth.
    most_rows = max(1, token_budget // seq_len)
    count = -(-len(trajs) // most_rows)
    rows = -(-len(trajs) // count)
    batches = []
    for start in range(0, len(trajs), rows):
        idx = list(range(start, min(start + rows, len(trajs))))
        batches.append(_collate(trajs, idx, rows, seq_len, pad_id))
    return batches


# Cut points the search considers at most (~30 ms of Python at this many): long-context batches can
# have thousands of distinct lengths.
_MAX_CUTS = 192


def split_by_length(sorted_lengths: Sequence[int], token_budget: int,
                    overhead_tokens: int = MICRO_BATCH_OVERHEAD_TOKENS["cpu"]) -> List[List[int]]:
    """Split ascending lengths into runs (index lists), each padded to its last (longest) length
    and within ``token_budget`` (a longer sequence alone), minimising padded tokens plus
    ``overhead_tokens`` per run: what a micro-batch costs whatever its size, in tokens.

    Dynamic programming over the boundaries between distinct lengths (a run that spans equal
    lengths pads nothing more by splitting there): best[j] = min over i < j of best[i] + the cost
    of rows i..j-1, where rows over the budget are cut into as many runs as the budget needs."""
    n = len(sorted_lengths)
    if not n:
        return []
    cuts = [0] + [k for k in range(1, n) if sorted_lengths[k] != sorted_lengths[k - 1]] + [n]
    if len(cuts) > _MAX_CUTS:  # quadratic in the cut points: keep evenly spaced ones
        stride = -(-len(cuts) // _MAX_CUTS)
        cuts = cuts[:-1:stride] + [n]
    best = [0.0] + [float("inf")] * (len(cuts) - 1)
    choice = [0] * len(cuts)
    for j in range(1, len(cuts)):
        longest = sorted_lengths[cuts[j] - 1]
        per_run = max(1, token_budget // longest)
        for i in range(j):
            rows = cuts[j] - cuts[i]
            runs = -(-rows // per_run)
            cost = best[i] + runs * overhead_tokens + rows * longest
            if cost < best[j]:
                best[j], choice[j] = cost, i
    bounds, j = [], len(cuts) - 1
    while j:
        bounds.append((cuts[choice[j]], cuts[j]))
        j = choice[j]
    groups: List[List[int]] = []
    for start, end in reversed(bounds):
        per_run = max(1, token_budget // sorted_lengths[end - 1])
        runs = -(-(end - start) // per_run)
        # Equal-sized runs: the last is not left with a few rows padded to the longest length.
        size = -(-(end - start) // runs)
        groups.extend(list(range(k, min(k + size, end))) for k in range(start, end, size))
    return groups


def build_shared_micro_batches(trajs: Sequence[Trajectory], token_budget: int, pad_id: int = 0,
                               overhead_tokens: int = MICRO_BATCH_OVERHEAD_TOKENS["cpu"]) -> List[MicroBatch]:
    """Micro-batches whose forward runs each group's prompt once (``learner.share_prompts``).
    Samples with the same prompt (uid and tokens) form a group; groups are cut into micro-batches
    by their row length (prompt + all responses) as ``split_by_length`` cuts sequences."""
    if not trajs:
        return []
    # The samples' own rows (labels, masks, per-token fields, and the logits gathered for them)
    # hold the last prompt token and the response: the prompt's other places would only be
    # masked out, and a long prompt's logits over the vocabulary are most of the memory.
    rows = [replace(t, prompt_ids=t.prompt_ids[-1:], routed_experts=None) for t in trajs]
    by_prompt: Dict[Tuple, List[int]] = {}
    for i, t in enumerate(trajs):
        by_prompt.setdefault((t.prompt_uid, tuple(t.prompt_ids)), []).append(i)
    groups = list(by_prompt.values())
    row_len = [len(trajs[g[0]].prompt_ids) + sum(len(trajs[i].response_ids) for i in g) for g in groups]
    order = sorted(range(len(groups)), key=lambda k: row_len[k])
    batches = []
    for run in split_by_length([row_len[k] for k in order], token_budget, overhead_tokens):
        members = [groups[order[k]] for k in run]
        idx = [i for g in members for i in g]
        mb = _collate(trajs, idx, len(idx), 1 + max(len(trajs[i].response_ids) for i in idx), pad_id,
                      [rows[i] for i in idx])
        mb.shared = _shared_forward(trajs, members, row_len[order[run[-1]]], mb.seq_len, pad_id)
        mb.routing = _shared_routing(trajs, members, row_len[order[run[-1]]])
        batches.append(mb)
    return batches


def _shared_forward(trajs: Sequence[Trajectory], groups: List[List[int]], seq_len: int, rows_seq_len: int,
                    pad_id: int) -> SharedForward:
    tokens = torch.full((len(groups), seq_len), pad_id, dtype=torch.long)
    positions = torch.zeros((len(groups), seq_len), dtype=torch.long)
    logit_index = torch.zeros((sum(map(len, groups)), rows_seq_len), dtype=torch.long)  # padding: slot 0
    segments = []
    row = 0
    for g, members in enumerate(groups):
        prompt = trajs[members[0]].prompt_ids
        p, base = len(prompt), g * seq_len
        ids, pos = list(prompt), list(range(p))
        prompt_slots = list(range(base, base + p))
        segments.append(([], prompt_slots))
        for i in members:
            response = trajs[i].response_ids
            start = base + len(ids)
            own = list(range(start, start + len(response)))
            if own:
                segments.append((prompt_slots, own))
            # Its row (last prompt token, response) reads the logits of the prompt's last slot,
            # then of its response's slots.
            logit_index[row, : 1 + len(response)] = torch.tensor(prompt_slots[-1:] + own, dtype=torch.long)
            ids.extend(response)
            pos.extend(range(p, p + len(response)))
            row += 1
        tokens[g, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        positions[g, : len(pos)] = torch.tensor(pos, dtype=torch.long)
    return SharedForward(tokens, positions, build_segment_layout(segments, len(groups) * seq_len), logit_index)


def _shared_routing(trajs: Sequence[Trajectory], groups: List[List[int]], seq_len: int) -> Optional[torch.Tensor]:
    """The routing of a shared forward (``_shared_forward``'s layout): each group's prompt as its
    first sample recorded it, then each response's own positions."""
    pieces = []
    for g, members in enumerate(groups):
        p = len(trajs[members[0]].prompt_ids)
        at = p
        prompt_from = next((trajs[i].routed_experts for i in members if trajs[i].routed_experts is not None), None)
        if prompt_from is not None:
            pieces.append((g, 0, np.asarray(prompt_from)[:p]))
        for i in members:
            n = len(trajs[i].response_ids)
            if trajs[i].routed_experts is not None:
                pieces.append((g, at, np.asarray(trajs[i].routed_experts)[p : p + n]))
            at += n
    return routing_tensor(pieces, len(groups), seq_len)


def _recorded(traj: Trajectory) -> np.ndarray:
    routed = np.asarray(traj.routed_experts)
    n = len(traj.prompt_ids) + len(traj.response_ids)
    if routed.ndim != 3 or len(routed) > n:
        raise ValueError(f"trajectory {traj.prompt_uid}/{traj.sample_index}: routed experts of shape "
                         f"{routed.shape} for {n} tokens (expected [tokens, moe_layers, top_k])")
    return routed


def routing_tensor(pieces: Sequence[Tuple[int, int, np.ndarray]], rows: int, seq_len: int) -> Optional[torch.Tensor]:
    """Recorded routing for a [rows, seq_len] forward, [moe_layers, seq_len · rows, top_k], from
    (row, first place, [places, moe_layers, top_k] choices) pieces; "unrecorded" (255 in uint8,
    -1 otherwise) everywhere else, so padding and the last token route by the learner's router.
    Tokens are in the router's order: megatron-core runs [s, b] activations and flattens them
    sequence-major, so row b's place s is token s · rows + b. None when there is no piece."""
    if not pieces:
        return None
    first = pieces[0][2]
    fill = 255 if first.dtype == np.uint8 else -1
    out = np.full((seq_len, rows, *first.shape[1:]), fill, dtype=first.dtype)
    for row, start, choices in pieces:
        if start + len(choices) > seq_len:
            raise ValueError(f"routing for places {start}..{start + len(choices) - 1} of a {seq_len}-place row: the "
                             "recorded routing does not match the sequence")
        out[start : start + len(choices), row] = choices
    layers, top_k = first.shape[1:]
    return torch.from_numpy(np.ascontiguousarray(out.reshape(seq_len * rows, layers, top_k).transpose(1, 0, 2)))


def _collate(samples: Sequence[Trajectory], idx: List[int], rows: int, seq_len: int, pad_id: int,
             row_trajs: Optional[Sequence[Trajectory]] = None) -> MicroBatch:
    """One micro-batch of samples ``idx`` of ``samples`` (a TrainBatch, or plain trajectories for a
    forward-only pass), ``rows`` rows of ``seq_len``; ``row_trajs``: what each row runs, when not
    the samples themselves (a shared prompt's rows hold its last token only)."""
    trajs = row_trajs if row_trajs is not None else [samples[i] for i in idx]
    # numpy buffers filled a row slice at a time: one conversion per row and field, and none of
    # torch.tensor's per-element cost on Python lists (~3x numpy's; ~12 ms for a 16k-token
    # micro-batch, spent on the learner's critical path while the GPU waits).
    shape = (rows, seq_len)
    tokens = np.full(shape, pad_id, dtype=np.int64)
    labels = np.full(shape, pad_id, dtype=np.int64)
    per_token = {name: np.zeros(shape, dtype=np.float32) for name in _TOKEN_FIELDS}
    for r, traj in enumerate(trajs):
        p = len(traj.prompt_ids)
        n = p + len(traj.response_ids)
        if p == 0:
            raise ValueError(f"trajectory {traj.prompt_uid}/{traj.sample_index} has no prompt token: no logit "
                             "predicts its first response token (start each sample with at least one prompt token)")
        tokens[r, :p] = traj.prompt_ids
        tokens[r, p:n] = traj.response_ids
        labels[r, : n - 1] = tokens[r, 1:n]
        # Logits at position p-1+i predict response token i.
        for name, vals in token_values(samples, idx[r]).items():
            if len(vals) != n - p:  # the row's values would silently shift
                raise ValueError(f"trajectory {traj.prompt_uid}/{traj.sample_index}: {name} has {len(vals)} "
                                 f"values for {n - p} response tokens")
            per_token[name][r, p - 1 : n - 1] = vals
    routing = routing_tensor([(r, 0, _recorded(t)) for r, t in enumerate(trajs) if t.routed_experts is not None],
                             rows, seq_len)
    return MicroBatch(tokens=torch.from_numpy(tokens), labels=torch.from_numpy(labels),
                      rows=idx + [-1] * (rows - len(trajs)), routing=routing,
                      **{name: torch.from_numpy(field) for name, field in per_token.items()})


def response_values(mb: MicroBatch, values: torch.Tensor, trajs: Sequence[Trajectory]) -> Dict[int, List[float]]:
    """Per-response-token values (e.g. logprobs [b, s]) of each real row, keyed by trajectory index."""
    out: Dict[int, List[float]] = {}
    for r, i in enumerate(mb.rows):
        if i < 0:
            continue
        # A shared-prompt micro-batch's rows start at the prompt's last token.
        p = 1 if mb.shared is not None else len(trajs[i].prompt_ids)
        n = len(trajs[i].response_ids)
        out[i] = values[r, p - 1 : p - 1 + n].tolist()
    return out
