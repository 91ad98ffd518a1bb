"""Logit-distillation losses as pure functions of the student's and the teacher's logits: the divergences of TRL
1.16's `DistillationTrainer` (its chunked generalized JSD) and GKD's `generalized_jsd_loss`, the teacher's top-k
support, and the mix with the hard-label cross-entropy. tests/refs/test_distill_loss.py checks them against TRL's
own functions on two transformers models' logits; tests/parity/test_distill_tp.py checks the vocab-sharded form.

The seam for the training step: `distill_loss_sum(student_logits, teacher_logits, labels, distill_config)` returns
a SUM over the counted tokens (labels != ignore_index: prompt and padding are not counted), like the step's
cross-entropy, so the step's global-token normalisation makes it TRL's `sum / num_items_in_batch` on every layout.

Definitions (per counted token; z_s, z_t the logits, T the temperature, p = softmax(z / T) over the support):
  forward_kl   KL(p_t || p_s) = sum_v p_t (log p_t - log p_s)                      (TRL beta 0)
  reverse_kl   KL(p_s || p_t) = sum_v p_s (log p_s - log p_t)                      (TRL beta 1)
  jsd(beta)    beta KL(p_t || m) + (1 - beta) KL(p_s || m), m = beta p_t + (1 - beta) p_s   (TRL's beta)
  loss         alpha * divergence + (1 - alpha) * cross_entropy(z_s, label)   (untempered CE; TRL: alpha 1)
No T^2 factor: TRL 1.16 applies none (Hinton et al. scale the soft term by T^2; set alpha to compensate).

top_k (no TRL counterpart): the support S is the teacher's k largest tempered logits of the token, every logit equal
to the k-th kept as well (ties; a tie-free token keeps exactly k). Both distributions are renormalised over S:
p(v) = exp(z_v / T) / sum_{u in S} exp(z_u / T) for v in S, 0 elsewhere; the divergence is the one above over S.
Restricting the student too keeps reverse_kl and jsd finite (the teacher has no mass outside S).

Tensor parallelism: when both logits are DTensors sharded on the vocabulary (Shard(-1): the `vocab_head` style,
under `loss_parallel`, which the step already enters for cross-entropy), every operation here runs on the shards:
the log-softmax's max and log-sum-exp are reduced over the tp group by loss_parallel, the element-wise terms stay
sharded, the vocabulary sum is a partial sum reduced once per token, and the top-k support gathers only k
candidates per token and rank. Full logits are never gathered.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

# A logit outside the top-k support: exp() of it underflows to exactly 0 in float32 and float64, and it stays
# finite, so the masked terms are exact zeros with finite gradients (-inf would make 0 * inf = nan).
OUTSIDE_SUPPORT = -1.0e30


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _replicated_like(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """x as a replicated DTensor on ref's mesh when ref is a DTensor (DTensor ops take no plain tensors)."""
    if isinstance(ref, DTensor) and not isinstance(x, DTensor):
        return DTensor.from_local(x, ref.device_mesh, [Replicate()] * ref.device_mesh.ndim, run_check=False)
    return x


def _local_topk_candidates(z: torch.Tensor, k: int) -> torch.Tensor:
    """This shard's k largest values per token, padded with -inf where the shard holds fewer than k."""
    local = min(k, z.shape[-1])
    vals = z.topk(local, dim=-1).values
    if local < k:
        vals = torch.cat([vals, vals.new_full((*vals.shape[:-1], k - local), -math.inf)], dim=-1)
    return vals


@torch.no_grad()
def teacher_support(teacher_logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Bool mask, shaped (and sharded) as the logits: True on each token's top_k teacher logits (and their ties).
    Under tensor parallelism each rank offers its own k largest; the k-th largest of all offers is the threshold."""
    if not isinstance(teacher_logits, DTensor):
        threshold = teacher_logits.topk(top_k, dim=-1).values[..., -1:]
        return teacher_logits >= threshold
    mesh, placements = teacher_logits.device_mesh, teacher_logits.placements
    local = teacher_logits.to_local()
    offers = _local_topk_candidates(local, top_k)
    gathered = DTensor.from_local(offers, mesh, placements, run_check=False).full_tensor()
    threshold = gathered.topk(top_k, dim=-1).values[..., -1:]
    shape, stride = teacher_logits.shape, teacher_logits.stride()  # an uneven vocabulary split keeps its shape
    return DTensor.from_local(local >= threshold, mesh, placements, run_check=False, shape=shape, stride=stride)


def _restrict(z: torch.Tensor, support: torch.Tensor | None) -> torch.Tensor:
    if support is None:
        return z
    return torch.where(support, z, torch.full_like(z, OUTSIDE_SUPPORT))


def _log_softmax(z: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dimension. On a vocab-sharded DTensor it is written out: the max and the sum of
    exponentials are reduced over the tp group ([tokens, 1] each) and the rest stays on the shards. loss_parallel's
    own log_softmax is not used: its backward passes the gradient through unchanged, right only when nll_loss follows
    (cross-entropy), not for a divergence."""
    if not isinstance(z, DTensor):
        return F.log_softmax(z, dim=-1)
    shifted = z - z.detach().amax(-1, keepdim=True)
    return shifted - shifted.exp().sum(-1, keepdim=True).log()


def token_divergence(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    loss: str,
    beta: float = 0.5,
    temperature: float = 1.0,
    top_k: int | None = None,
) -> torch.Tensor:
    """[..., V] logits -> [...] divergence per token (definitions in the module docstring), float32 (float64
    stays); gradients reach the student only."""
    dtype = _compute_dtype(student_logits)
    zs = student_logits.to(dtype) / temperature
    zt = teacher_logits.detach().to(dtype) / temperature
    support = teacher_support(zt, top_k) if top_k is not None else None
    log_ps = _log_softmax(_restrict(zs, support))
    log_pt = _log_softmax(_restrict(zt, support))
    if loss == "forward_kl":
        terms = log_pt.exp() * (log_pt - log_ps)
    elif loss == "reverse_kl":
        terms = log_ps.exp() * (log_ps - log_pt)
    elif loss == "jsd":
        log_m = torch.logaddexp(log_ps + math.log1p(-beta), log_pt + math.log(beta))
        terms = beta * log_pt.exp() * (log_pt - log_m) + (1 - beta) * log_ps.exp() * (log_ps - log_m)
    else:
        raise ValueError(f"unknown divergence {loss!r}: forward_kl, reverse_kl or jsd")
    return terms.sum(-1)


def _summed_cross_entropy(student_logits: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    dtype = _compute_dtype(student_logits)
    return F.cross_entropy(
        student_logits.flatten(0, -2).to(dtype), labels.flatten(), ignore_index=ignore_index, reduction="sum"
    )


def _full(x: torch.Tensor) -> torch.Tensor:
    return x.full_tensor() if isinstance(x, DTensor) else x


def distill_loss_sum(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    distill_config,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(alpha * summed divergence + (1 - alpha) * summed cross-entropy over the counted tokens, {"divergence_sum",
    "ce_sum", "tokens"} detached). student_logits/teacher_logits: [B, S, V] (or vocab-sharded DTensors of it),
    labels: [B, S] aligned with the logits (labels[t] is the token position t predicts), ignore_index where not
    counted. `distill_config`: config/distill_schema.py's DistillConfig (loss, beta, temperature, alpha, top_k).
    Divide by the global counted-token count for TRL's mean (the step's normalisation does)."""
    dc = distill_config
    per_token = token_divergence(student_logits, teacher_logits, dc.loss, dc.beta, dc.temperature, dc.top_k)
    counted = labels != ignore_index
    divergence = (per_token * _replicated_like(counted.to(per_token.dtype), per_token)).sum()
    divergence = _full(divergence)
    loss = dc.alpha * divergence
    ce = torch.zeros((), dtype=divergence.dtype, device=divergence.device)
    if dc.alpha < 1:
        ce = _full(_summed_cross_entropy(student_logits, labels, ignore_index))
        loss = loss + (1 - dc.alpha) * ce
    metrics = {"divergence_sum": divergence.detach(), "ce_sum": ce.detach(), "tokens": counted.sum()}
    return loss, metrics
