"""`MoEBlock`: route every token to its top-k experts, run them, combine by the gate weights, add shared experts.

Dispatch is a stable sort of the (token, choice) pairs by expert: rows reach `GroupedExperts` grouped by expert, and
each result goes back to its (token, choice) slot before the weighted sum, so the sum runs in a fixed order and a
token's output does not depend on which other tokens share its experts (the same in one process and under expert
parallelism). With `capacity_factor` an expert takes at most its capacity of a micro-batch's rows; the rest are
dropped by lowest gate weight first (balance.py `capacity_keep`) and contribute zero, and the dropped fraction is
reported (train/moe_balance.py). Load-balancing losses, the z-loss and the statistics that the bias update and the
metrics read are balance.py's (`account`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshformer.config.schema import ModelConfig
from meshformer.models.moe import balance
from meshformer.models.moe.experts import GroupedExperts
from meshformer.models.moe.router import Router
from meshformer.models.moe.validate import aux_losses


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) of a given width (shared experts; the dense MLP's form)."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEBlock(nn.Module):
    """gate (Router), experts (GroupedExperts), optional shared_experts (SwiGLU) and shared_expert_gate (Qwen2-MoE's
    sigmoid gate, Linear(hidden, 1)). Our names; the families' adapters map Hugging Face's per-expert ones."""

    def __init__(self, mc: ModelConfig, layer_idx: int):
        super().__init__()
        m = mc.moe_config
        self.layer_idx = layer_idx
        self.config = m
        self.num_experts, self.top_k = m.expert_num, m.num_experts_chosen
        self.gate = Router(mc)
        self.experts = GroupedExperts(
            m.expert_num, mc.hidden_size, mc.expert_ffn_size, m.use_gmm,
            m.expert_bias, m.expert_activation, m.swiglu_alpha, m.swiglu_limit,
        )  # fmt: skip
        shared = mc.shared_ffn_size
        self.shared_experts = SwiGLU(mc.hidden_size, shared) if shared else None
        self.shared_expert_gate = nn.Linear(mc.hidden_size, 1, bias=False) if shared and m.shared_expert_gate else None
        self.stats = balance.LayerStats(m.expert_num)  # this step's load (balance.py), not a parameter
        self.aux_losses = aux_losses(mc)  # {balancing loss type: coefficient} (balance.py)
        self.needs_global_counts = "global_batch" in self.aux_losses  # train/moe_balance.py routing_prepass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [batch, seq, hidden] -> the same shape."""
        b, s, h = x.shape
        flat = x.reshape(-1, h)
        route = self.gate(flat)
        weights = route.weights
        keep = balance.capacity_keep(route, self.num_experts, self.config.capacity_factor)
        if keep is not None:
            weights = weights * keep
        out = self._routed(flat, route.indices, weights, keep)
        out = balance.account(self, route, keep, (b, s), out)
        if self.shared_experts is not None:
            shared = self.shared_experts(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        return out.view(b, s, h)

    def _routed(self, flat, indices, weights, keep) -> torch.Tensor:
        n, k = indices.shape
        choice = indices.reshape(-1)
        if keep is not None:  # dropped (token, choice) pairs go to no expert
            choice = torch.where(keep.reshape(-1) > 0, choice, self.num_experts)
        order = torch.argsort(choice, stable=True)
        counts = torch.bincount(choice, minlength=self.num_experts + 1)
        kept = int(n * k - counts[self.num_experts]) if keep is not None else n * k
        order = order[:kept]
        rows = flat[order // k]
        y = self.experts(rows, counts[: self.num_experts])
        slots = y.new_zeros(n * k, y.shape[-1])
        slots[order] = y
        out = (slots.view(n, k, -1) * weights.unsqueeze(-1).to(y.dtype)).sum(dim=1)
        return out.to(flat.dtype)
