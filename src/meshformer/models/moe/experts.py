"""Routed SwiGLU experts with stacked weights: gate_proj / up_proj [experts, ffn, hidden], down_proj [experts, hidden,
ffn] (Hugging Face stores them per expert on disk, `mlp.experts.E.gate_proj.weight`; the families' adapters stack and
split them).

`forward(x, counts)` takes the routed rows sorted by expert (counts[e] rows for expert e, in order) and returns each
row through its expert. Expert parallelism (parallel/expert_parallel.py) wraps this forward: rows then arrive from
every rank of the ep group and the weights hold only this rank's experts, so nothing here assumes all experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshformer.backends.torch_private import grouped_mm, grouped_mm_supported


class GroupedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, ffn: int, use_gmm: bool | None = None):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(num_experts, ffn, hidden))
        self.up_proj = nn.Parameter(torch.empty(num_experts, ffn, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, ffn))
        self.use_gmm = use_gmm  # None: grouped where torch can run it on these shapes and this device

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: [rows, hidden] sorted by expert, rows == counts.sum(); counts: [local experts] int."""
        return self.compute(x, counts, *self.local_weights())

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """gate, up, down as this rank computes with them (its experts' shards under expert parallelism)."""
        return _local(self.gate_proj), _local(self.up_proj), _local(self.down_proj)

    def compute(self, x, counts, gate, up, down) -> torch.Tensor:
        """The experts' math on given weights (expert parallelism passes its local shards)."""
        # Autocast has no rule for grouped matmuls (nor for stacked weights): cast to its dtype here, as it
        # would cast a linear's input and weight.
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        x = x.to(dtype)
        if gate.dtype != dtype:
            gate, up, down = gate.to(dtype), up.to(dtype), down.to(dtype)
        use = self.use_gmm if self.use_gmm is not None else grouped_mm_supported(x, gate, down)
        if use:
            return grouped_experts(x, counts, gate, up, down)
        return looped_experts(x, counts, gate, up, down)


def _local(w: torch.Tensor) -> torch.Tensor:
    """The tensor a rank computes with (a DTensor's local shard under expert parallelism)."""
    return w.to_local() if hasattr(w, "to_local") else w


def grouped_experts(x, counts, gate, up, down) -> torch.Tensor:
    """Three grouped matmuls over all experts at once (torch._grouped_mm)."""
    offs = torch.cumsum(counts, 0).to(torch.int32)
    h = F.silu(grouped_mm(x, gate.transpose(-2, -1), offs)) * grouped_mm(x, up.transpose(-2, -1), offs)
    return grouped_mm(h, down.transpose(-2, -1), offs)


def looped_experts(x, counts, gate, up, down) -> torch.Tensor:
    """One expert after another (the reference, and where grouped matmuls cannot run)."""
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        rows = x[start : start + n]
        outs.append(F.linear(F.silu(F.linear(rows, gate[e])) * F.linear(rows, up[e]), down[e]))
        start += n
    return torch.cat(outs) if outs else x.new_zeros(0, down.shape[1])
