"""Load balancing of MoE layers: capacity drops, the balancing losses, the routing-bias update, load statistics.

(Interim: statistics only; the losses and the bias update follow.)
"""

from __future__ import annotations

import torch


class LayerStats:
    """One MoE layer's tokens per expert over the current step's counted forwards (detached)."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.tokens_per_expert: torch.Tensor | None = None
        self.dropped = 0.0
        self.routed = 0.0

    def reset(self) -> None:
        self.tokens_per_expert, self.dropped, self.routed = None, 0.0, 0.0


def capacity_keep(route, num_experts: int, capacity_factor: float | None) -> torch.Tensor | None:
    """[tokens, k] 1.0 for kept (token, choice) pairs, 0.0 for dropped ones; None when nothing is ever dropped."""
    if capacity_factor is None:
        return None
    raise NotImplementedError("capacity_factor")


def account(block, route, keep, shape, out: torch.Tensor) -> torch.Tensor:
    """Record the layer's load; attach the configured balancing losses to `out` (models/aux_loss.py)."""
    counts = torch.bincount(route.indices.reshape(-1), minlength=block.num_experts).detach()
    st = block.stats
    st.tokens_per_expert = counts if st.tokens_per_expert is None else st.tokens_per_expert + counts
    return out
