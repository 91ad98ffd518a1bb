"""Expert parallelism (`parallel_config.expert_parallel`): each MoE layer's routed experts split over the `ep` mesh.

`apply_expert_parallel` makes every `GroupedExperts` weight (and bias) a DTensor sharded by expert (Shard(0)) over
"ep" (the ranks parallel/dims.py lends it from dp_shard x cp), so a distributed checkpoint reshards to any other ep, and
wraps the experts' forward:

1. all-to-all of the per-expert row counts (this rank's counts for every expert -> every rank's counts for this
   rank's experts), read on the host: they are the split sizes;
2. the rows, sorted by expert as `MoEBlock` hands them over, go to the rank owning their experts
   (`all_to_all_single_autograd`, so backward sends the gradients back the same way);
3. the received rows (grouped by source rank, then expert) are permuted so each local expert's rows are
   contiguous, the local experts compute, the permutation is undone and a second all-to-all returns every row to
   the rank and the slot it came from. A row meets the same expert math as in one process; `MoEBlock` then sums
   each token's choices in its own fixed order, so the output does not depend on the layout.

Gradients: an expert's weight gradient on one rank sums the rows of its whole ep group, and data parallelism then
averages it over the ranks holding the same experts ("efsdp", and "dp_replicate"), which are 1/ep of the loss mesh
the loss was pre-scaled for (ParallelEnv.grad_average_size): without a correction every expert gradient is ep
times too large (pytorch/pytorch#160285). The weights' gradients are divided by ep inside the forward, so the
correction holds whatever reduces them afterwards (FSDP over efsdp, or nothing when efsdp x dp_replicate = 1,
where FSDP would ignore a divide factor: pytorch/pytorch#167178).

Under tensor parallelism (etp = tp) the experts stay whole on every tp rank: those ranks hold the same tokens and
each computes them, in a separate ep group. Recompute re-runs the all-to-alls with the same counts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from meshformer.backends.torch_private import all_to_all_autograd
from meshformer.models.moe.experts import GroupedExperts
from meshformer.parallel.env import ParallelEnv


def routed_experts(model: nn.Module) -> list[GroupedExperts]:
    return [m for m in model.modules() if isinstance(m, GroupedExperts)]


def expert_params(model: nn.Module) -> set[nn.Parameter]:
    """The routed experts' weights and biases (what FSDP over the dense mesh must leave to the experts' own mesh)."""
    return {getattr(m, name) for m in routed_experts(model) for name in m.weight_names()}


def apply_expert_parallel(model: nn.Module, env: ParallelEnv) -> None:
    """Shard every routed expert layer of a (meta-device) model part over the ep mesh, in place."""
    if env.dims.ep == 1:
        return
    mesh = env.mesh_for("ep")
    for experts in routed_experts(model):
        for name in experts.weight_names():  # biases too: each expert's bias lives with its weights
            p = getattr(experts, name)
            local = p.to_local() if isinstance(p, DTensor) else p  # replicated over tp: whole on every tp rank
            sharded = distribute_tensor(local.detach(), mesh, [Shard(0)], src_data_rank=None)
            setattr(experts, name, nn.Parameter(sharded, requires_grad=p.requires_grad))
        experts.forward = _ExpertParallelForward(experts, mesh)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times `scale` (expert weights: see the module docstring)."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class _ExpertParallelForward:
    """The experts' forward under expert parallelism (an instance attribute, so the module stays a GroupedExperts)."""

    def __init__(self, experts: GroupedExperts, mesh):
        self.experts, self.group, self.ep = experts, mesh.get_group(), mesh.size()

    def __call__(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: [rows, hidden] sorted by expert over all experts; counts: [experts] rows per expert on this rank."""
        ep, group = self.ep, self.group
        local_experts = counts.numel() // ep
        counts = counts.to(torch.int64)
        # received[s * L + j]: rows rank s sends for this rank's local expert j
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)
        send = counts.view(ep, local_experts).sum(1).tolist()
        recv = received.view(ep, local_experts).sum(1).tolist()
        rows = all_to_all_autograd(x, recv, send, group)
        # Rows arrive grouped by (source rank, local expert); the experts want them grouped by (expert, source).
        segment = torch.repeat_interleave(torch.arange(ep * local_experts, device=x.device), received.to(x.device))
        order = torch.argsort((segment % local_experts) * ep + segment // local_experts, stable=True)
        weights = [_ScaleGrad.apply(w, 1.0 / ep) for w in self.experts.local_weights()]
        y = self.experts.compute(rows[order], received.view(ep, local_experts).sum(0), *weights)
        back = y[torch.argsort(order)]
        return all_to_all_autograd(back, send, recv, group)
