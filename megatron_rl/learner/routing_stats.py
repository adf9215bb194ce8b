"""Per-step statistics of mixture-of-experts routing in the learner's proximal pass (the forward
over the batch with the weights about to be updated), against the routing the engine recorded:

- ``moe/router_agreement``: the share of recorded choices (token × layer × top-k) that the
  learner's own router also makes. Counted before replay overrides the router, so it reads the
  same with routing replay on or off; 1 means the two forwards route alike.
- ``moe/expert_load_max_over_mean``: per MoE layer, the tokens of its busiest expert over the mean
  per expert (1 = balanced; top-k of E experts gives at most E / k), averaged over the layers.
  Counted over the recorded tokens, as the forward routed them (the engine's choices when
  replaying).

Each rank counts its own pipeline stage's layers and its replica's share of the batch; reading
the metrics sums them over stages and replicas, a collective every learner rank joins.
"""

from __future__ import annotations

from typing import Dict

import torch

from ..models.routing import RoutingReplay, num_moe_layers
from .data_parallel import sum_over_stages_and_replicas


class RoutingStats:
    def __init__(self, model_config) -> None:
        self.layers = num_moe_layers(model_config)
        self.experts = model_config.num_moe_experts
        self._reset()

    def _reset(self) -> None:
        self.agree = 0
        self.total = 0
        self.load = torch.zeros(self.layers, self.experts, dtype=torch.float64)

    def add(self, replay: RoutingReplay) -> None:
        """What one pass's replay counted (one host read)."""
        agree, total = replay.agreement()
        self.agree += agree
        self.total += total
        load = replay.expert_load()
        if load is not None:
            index = torch.tensor([layer.moe_index for layer in replay.layers], dtype=torch.long)
            self.load.index_add_(0, index, load.detach().cpu())

    def pop_metrics(self) -> Dict[str, float]:
        """The step's metrics (none when nothing was recorded), summed over every learner rank's
        part; counting starts afresh. Collective: every learner rank calls it."""
        flat = torch.cat([torch.tensor([self.agree, self.total], dtype=torch.float64), self.load.reshape(-1)])
        flat = sum_over_stages_and_replicas(flat)
        self._reset()
        agree, total, load = flat[0].item(), flat[1].item(), flat[2:].view(self.layers, self.experts)
        if total == 0:
            return {}
        used = load.sum(dim=1) > 0
        balance = (load[used].max(dim=1).values / load[used].mean(dim=1)).mean().item()
        return {"moe/router_agreement": agree / total, "moe/expert_load_max_over_mean": balance}
