"""The router of an MoE layer: scores in fp32, top-k choice, gate weights.

Variants (the families' own code, transformers 5.x): softmax scores, top-k, optionally renormalised (Mixtral always,
Qwen-MoE with norm_topk_prob); DeepSeek-V2's group-limited greedy (groups scored by their best expert); DeepSeek-V3's
sigmoid scores with a score-correction bias that only chooses experts (noaux_tc: groups scored by the sum of their top
two biased scores), weights from the unbiased scores, renormalised, times routed_scaling_factor. Masked groups are
filled with -inf, as transformers 5's DeepSeek-V3 and torchtitan do (DeepSeek-V2's 0.0 chooses the same experts:
its softmax scores are positive, and validation keeps at least top-k experts in the groups a token may use; with a
bias, biased scores can be negative and 0.0 would let a masked expert win).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshformer.config.schema import ModelConfig


@dataclass
class RouterOutput:
    logits: torch.Tensor  # [tokens, experts] fp32, before the score function (z-loss)
    scores: torch.Tensor  # [tokens, experts] fp32: softmax or sigmoid of the logits (balancing losses)
    indices: torch.Tensor  # [tokens, k] chosen experts
    weights: torch.Tensor  # [tokens, k] fp32 gate weights of the chosen experts


class Router(nn.Module):
    """weight [experts, hidden] (Hugging Face's `mlp.gate.weight`) and, with `router_bias`, bias [experts] added to the
    logits; `e_score_correction_bias` [experts], a persistent fp32 buffer, where routing uses one (noaux_tc, or
    balance_via_topk_bias)."""

    def __init__(self, mc: ModelConfig):
        super().__init__()
        m = mc.moe_config
        self.num_experts, self.top_k = m.expert_num, m.num_experts_chosen
        self.sigmoid = m.use_gating_sigmoid
        self.topk_method, self.n_group, self.topk_group = m.topk_method, m.n_group, m.topk_group
        self.norm_topk_prob, self.scaling = m.norm_topk_prob, m.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(m.expert_num, mc.hidden_size))
        self.register_parameter("bias", nn.Parameter(torch.empty(m.expert_num)) if m.router_bias else None)
        if m.topk_method == "noaux_tc" or m.balance_via_topk_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(m.expert_num, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def reset_buffers(self) -> None:
        """A fresh model's bias is zero (models/init.py calls this after allocating)."""
        if self.e_score_correction_bias is not None:
            self.e_score_correction_bias.zero_()

    def forward(self, x: torch.Tensor) -> RouterOutput:
        """x: [tokens, hidden]."""
        weight = self.weight.to_local() if hasattr(self.weight, "to_local") else self.weight  # replicated over tp
        bias = None if self.bias is None else (self.bias.to_local() if hasattr(self.bias, "to_local") else self.bias)
        with torch.autocast(x.device.type, enabled=False):  # fp32 even inside a bf16 step's autocast
            logits = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        scores = logits.sigmoid() if self.sigmoid else logits.softmax(dim=-1)
        bias = self.e_score_correction_bias
        if bias is not None:  # replicated over tp like the weight (a DTensor there)
            choice = scores + (bias.to_local() if hasattr(bias, "to_local") else bias)
        else:
            choice = scores
        if self.topk_method != "greedy" and self.n_group > 1:
            choice = self._limit_groups(choice)
        indices = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, indices)
        if self.norm_topk_prob and self.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return RouterOutput(logits, scores, indices, weights * self.scaling)

    def _limit_groups(self, choice: torch.Tensor) -> torch.Tensor:
        grouped = choice.view(choice.shape[0], self.n_group, -1)
        if self.topk_method == "group_limited_greedy":
            group_scores = grouped.max(dim=-1).values
        else:  # noaux_tc
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        keep = torch.topk(group_scores, self.topk_group, dim=-1, sorted=False).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        return grouped.masked_fill(~mask[..., None], float("-inf")).view_as(choice)
