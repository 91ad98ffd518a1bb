"""Routed gated experts with stacked weights: gate_proj / up_proj [experts, ffn, hidden], down_proj [experts, hidden,
ffn] (Hugging Face stores them per expert on disk, `mlp.experts.E.gate_proj.weight`; the families' adapters stack and
split them), and with `moe_config.expert_bias` their biases gate_bias / up_bias [experts, ffn], down_bias [experts,
hidden] (Hugging Face's `nn.Linear` bias of each expert's projection: down's bias is added before the gate weight).

The gated activation (`moe_config.expert_activation`): silu, SwiGLU's silu(gate) * up; or clamped_swiglu, where gate
is clamped from above and up on both sides at `swiglu_limit`, then (up + 1) * gate * sigmoid(swiglu_alpha * gate)
(transformers 5's experts of that form apply exactly this, in this order).

`forward(x, counts)` takes the routed rows sorted by expert (counts[e] rows for expert e, in order) and returns each
row through its expert. Expert parallelism (parallel/expert_parallel.py) wraps this forward: rows then arrive from
every rank of the ep group and the weights hold only this rank's experts, so nothing here assumes all experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshformer.backends.torch_private import grouped_mm, grouped_mm_supported

ACTIVATIONS = ("silu", "clamped_swiglu")


class GroupedExperts(nn.Module):
    def __init__(
        self,
        num_experts: int,
        hidden: int,
        ffn: int,
        use_gmm: bool | None = None,
        bias: bool = False,
        activation: str = "silu",
        alpha: float = 1.702,
        limit: float = 7.0,
    ):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(num_experts, ffn, hidden))
        self.up_proj = nn.Parameter(torch.empty(num_experts, ffn, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, ffn))
        for name, width in (("gate_bias", ffn), ("up_bias", ffn), ("down_bias", hidden)):
            self.register_parameter(name, nn.Parameter(torch.empty(num_experts, width)) if bias else None)
        self.use_gmm = use_gmm  # None: grouped where torch can run it on these shapes and this device
        self.activation, self.alpha, self.limit = activation, alpha, limit

    def weight_names(self) -> tuple[str, ...]:
        """The stacked parameters, each [experts, ...] (what expert parallelism shards by expert)."""
        biases = ("gate_bias", "up_bias", "down_bias") if self.gate_bias is not None else ()
        return ("gate_proj", "up_proj", "down_proj", *biases)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: [rows, hidden] sorted by expert, rows == counts.sum(); counts: [local experts] int."""
        return self.compute(x, counts, *self.local_weights())

    def local_weights(self) -> tuple[torch.Tensor, ...]:
        """gate, up, down (and their biases) as this rank computes with them (its experts' shards under expert
        parallelism)."""
        return tuple(_local(getattr(self, name)) for name in self.weight_names())

    def compute(self, x, counts, gate, up, down, *biases) -> torch.Tensor:
        """The experts' math on given weights (expert parallelism passes its local shards)."""
        # Autocast has no rule for grouped matmuls (nor for stacked weights): cast to its dtype here, as it
        # would cast a linear's input and weight.
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        x = x.to(dtype)
        if gate.dtype != dtype:
            gate, up, down = gate.to(dtype), up.to(dtype), down.to(dtype)
        biases = tuple(b.to(dtype) for b in biases)
        glu = self.glu
        use = self.use_gmm if self.use_gmm is not None else grouped_mm_supported(x, gate, down)
        if use:
            return grouped_experts(x, counts, gate, up, down, *biases, glu=glu)
        return looped_experts(x, counts, gate, up, down, *biases, glu=glu)

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The gated activation of the gate and up projections' outputs."""
        if self.activation == "silu":
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def _local(w: torch.Tensor) -> torch.Tensor:
    """The tensor a rank computes with (a DTensor's local shard under expert parallelism)."""
    return w.to_local() if hasattr(w, "to_local") else w


def _silu_glu(gate, up):
    return F.silu(gate) * up


def grouped_experts(x, counts, gate, up, down, *biases, glu=_silu_glu) -> torch.Tensor:
    """Three grouped matmuls over all experts at once (torch._grouped_mm); biases added row by row."""
    offs = torch.cumsum(counts, 0).to(torch.int32)
    g, u = grouped_mm(x, gate.transpose(-2, -1), offs), grouped_mm(x, up.transpose(-2, -1), offs)
    if biases:
        expert = torch.repeat_interleave(torch.arange(counts.numel(), device=x.device), counts.to(x.device))
        g, u = g + biases[0][expert], u + biases[1][expert]
    y = grouped_mm(glu(g, u), down.transpose(-2, -1), offs)
    return y + biases[2][expert] if biases else y


def looped_experts(x, counts, gate, up, down, *biases, glu=_silu_glu) -> torch.Tensor:
    """One expert after another (the reference, and where grouped matmuls cannot run)."""
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        rows = x[start : start + n]
        gb, ub, db = (b[e] for b in biases) if biases else (None, None, None)
        outs.append(F.linear(glu(F.linear(rows, gate[e], gb), F.linear(rows, up[e], ub)), down[e], db))
        start += n
    return torch.cat(outs) if outs else x.new_zeros(0, down.shape[1])
