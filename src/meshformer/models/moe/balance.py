"""Load balancing of MoE layers: capacity drops, the balancing losses, the per-layer load statistics.

Capacity (`capacity_factor`, None by default: nothing dropped). Per micro-batch forward (on each rank, so it
depends on the layout by nature, as in every anchor) an expert takes at most ceil(capacity_factor x tokens x k /
experts) (token, choice) pairs. Drop policy (Megatron's "probs"): each expert keeps its pairs of highest gate
weight, ties broken by token order then choice order; a dropped pair contributes zero (the token's other
weights are not renormalised; shared experts and the residual still carry it). The dropped fraction is counted.

Balancing losses (`aux_loss_types` / `aux_loss_factors`, models/moe/validate.py `aux_losses`), each alpha x
sum_e f_e P_e per layer (DeepSeek-V3's and MindSpore's form: 1 x alpha when the load is uniform), with f_e =
E / (k T) x (tokens choosing e, before any capacity drop) and P_e the mean over the same T tokens of the
normalised router scores (softmax; sigmoid scores divided by their sum). Summed over layers, reported as
`aux_loss/moe_<type>`:
- sequence: f and P per sequence (T = its length), averaged over every sequence of the step (DeepSeek-V3's
  sequence-wise loss). A sequence is whole on a rank but under context parallelism, where each rank sums its
  tokens' counts with the other parts of its rows (`StepTotals.sum_over_row`, detached) and contributes its own
  tokens' share of P (the loss is linear in P: the parts add up to the whole row's), so any layout and
  accumulation split give the same loss.
- global_batch: f and P over every token of the step (all micro-batches, data-parallel ranks). f must be known
  before the first backward: train/moe_balance.py `routing_prepass` runs one forward without gradients over the
  step's micro-batches first (the cost: one extra forward per step) and sums its counts over the loss mesh. Exact
  for every layout (the model has no dropout, so the pre-pass routes as the real forwards do).
- micro_batch: f and P over one forward's tokens, averaged over the step's forwards (Hugging Face's
  router_aux_loss_coef loss, per layer): it changes with the micro-batch size and the data-parallel split.
- z-loss (`z_loss_factor`): factor x the mean over the step's tokens of logsumexp(router logits)^2.
Each is reported already normalised (models/aux_loss.py): its micro-batch's share of the global figure.

Statistics: every counted forward (not a recompute, not a pipeline's shape inference) adds its tokens per expert,
routed and dropped pairs to the layer's `LayerStats`; train/moe_balance.py sums them over the step and the ranks
for the routing-bias update and the metrics.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

from meshformer.models.aux_loss import counted_forward, report_aux_loss, step_totals

_RECORDING: list[bool] = []  # inside routing_prepass: forwards only count routes


class LayerStats:
    """One MoE layer's load over the current step's counted forwards (detached, this rank's tokens)."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.prepass: torch.Tensor | None = None  # tokens per expert seen by the routing pre-pass
        self.global_counts: torch.Tensor | None = None  # the pre-pass's counts over the loss mesh (global_batch)
        self.reset()

    def reset(self) -> None:
        self.tokens_per_expert: torch.Tensor | None = None
        self.dropped: torch.Tensor | float = 0.0  # (token, choice) pairs dropped by capacity
        self.routed = 0.0  # (token, choice) pairs routed


@contextlib.contextmanager
def recording_routes() -> Iterator[None]:
    """Forwards inside only add their tokens per expert to `LayerStats.prepass` (no losses, no statistics)."""
    _RECORDING.append(True)
    try:
        yield
    finally:
        _RECORDING.pop()


def capacity_keep(route, num_experts: int, capacity_factor: float | None) -> torch.Tensor | None:
    """[tokens, k] 1.0 for kept (token, choice) pairs, 0.0 for dropped ones; None when nothing is ever dropped."""
    if capacity_factor is None:
        return None
    n, k = route.indices.shape
    capacity = math.ceil(capacity_factor * n * k / num_experts)
    experts, weights = route.indices.reshape(-1), route.weights.reshape(-1).detach()
    order = torch.argsort(-weights, stable=True)  # highest weight first; ties keep (token, choice) order
    order = order[torch.argsort(experts[order], stable=True)]  # grouped by expert, that order kept inside
    counts = torch.bincount(experts, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(n * k, device=experts.device) - starts[experts[order]]
    keep = torch.zeros(n * k, dtype=torch.float32, device=experts.device)
    keep[order] = (rank < capacity).float()
    return keep.view(n, k)


@torch.compiler.disable  # Python-side statistics and step state: a compiled layer runs this part eagerly
def account(block, route, keep, shape, out: torch.Tensor) -> torch.Tensor:
    """Record the layer's load; attach the configured balancing losses to `out` (models/aux_loss.py)."""
    counts = torch.bincount(route.indices.reshape(-1), minlength=block.num_experts).detach()
    st = block.stats
    if _RECORDING:
        st.prepass = counts if st.prepass is None else st.prepass + counts
        return out
    if counted_forward():
        st.tokens_per_expert = counts if st.tokens_per_expert is None else st.tokens_per_expert + counts
        st.routed += route.indices.numel()
        if keep is not None:
            st.dropped = st.dropped + (keep == 0).sum().detach()
    totals = step_totals()
    if totals is None or not torch.is_grad_enabled():
        return out
    for kind, coef in block.aux_losses.items():
        value = coef * LOSSES[kind](block, route, counts, shape, totals)
        out = report_aux_loss(f"moe_{kind}", value, out, normalized=True)
    if block.config.z_loss_factor:
        z = torch.logsumexp(route.logits, dim=-1).pow(2).sum() / totals.tokens
        out = report_aux_loss("moe_z", block.config.z_loss_factor * z, out, normalized=True)
    return out


def _probs(block, route) -> torch.Tensor:
    """Router scores normalised over the experts (softmax scores already are)."""
    s = route.scores
    return s / (s.sum(dim=-1, keepdim=True) + 1e-20) if block.gate.sigmoid else s


def sequence_loss(block, route, counts, shape, totals) -> torch.Tensor:
    """This micro-batch's sequences' sum of f.P / the step's sequences."""
    (b, s), e, k = shape, block.num_experts, block.top_k
    idx = route.indices.reshape(b, s * k)
    per_seq = torch.zeros(b, e, device=idx.device).scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.float32))
    row = s * totals.row_parts  # the whole row's tokens
    if totals.sum_over_row is not None and per_seq.device.type != "meta":  # not a pipeline's shape inference
        per_seq = totals.sum_over_row(per_seq)
    f = per_seq * (e / (k * row))
    p = _probs(block, route).view(b, s, e).sum(dim=1) / row  # this rank's tokens' part of the row's mean
    return (f * p).sum() / totals.sequences


def global_batch_loss(block, route, counts, shape, totals) -> torch.Tensor:
    """Sum over this micro-batch's tokens of sum_e f_e p_te / the step's tokens, f from the whole step."""
    g = block.stats.global_counts
    if g is None:
        raise RuntimeError(
            "the global_batch balancing loss needs the step's expert counts first: the MoE balance hook "
            "(train/moe_balance.py MoeBalanceHook) routes the step before its forwards; pass it to train_step"
        )
    f = g.to(torch.float32) * (block.num_experts / (block.top_k * totals.tokens))
    return (_probs(block, route) @ f).sum() / totals.tokens


def micro_batch_loss(block, route, counts, shape, totals) -> torch.Tensor:
    """This forward's f.P / the step's forwards."""
    n = route.indices.shape[0]
    f = counts.to(torch.float32) * (block.num_experts / (block.top_k * n))
    return (f * _probs(block, route).mean(dim=0)).sum() / totals.micro_batches


LOSSES = {"sequence": sequence_loss, "global_batch": global_batch_loss, "micro_batch": micro_batch_loss}
