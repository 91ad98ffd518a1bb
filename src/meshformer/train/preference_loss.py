"""Preference losses as pure functions of per-sequence completion log-probabilities: DPO and its TRL loss types,
KTO (with its KL anchor z0), ORPO (odds ratio) and SimPO, each equal to TRL 1.16's code on the same inputs
(tests/refs/test_preference_loss.py calls TRL's own methods).

Why here (train/) and not a package of its own: the step (train/step.py) is the only caller, next to the other
loss-side modules (loss_scale.py, moe_balance.py); the data side lives in data/preference*.py, the config in
config/preference_schema.py. A loss takes tensors and returns (loss, metrics): no model, no process group, so every
layout can feed it the log-probs it gathered.

Conventions (TRL 1.16, trainer/dpo_trainer.py `_compute_loss`, trainer/kto_trainer.py, experimental/orpo,
experimental/cpo):
  - log-probs are SUMMED over completion tokens for DPO and KTO; ORPO and SimPO take the per-token MEAN
    (`sequence_logps(..., average=True)`); IPO and sigmoid_norm divide each summed log-ratio by its own length.
  - the loss is the MEAN over the pairs (KTO: over the examples, `nanmean`) of this micro-batch; several loss types
    add up with their weights (`loss_weights`, 1 each by default), e.g. MPO = sigmoid + bco_pair + sft.
  - metrics are batch means: rewards/chosen = mean(beta * (logp_c - ref_c)), rewards/rejected likewise,
    rewards/margins = mean of their difference, rewards/accuracies = share of pairs with r_c > r_r,
    logps/chosen and logps/rejected = mean of the (summed, or for ORPO/SimPO averaged) policy log-probs.
  - the `sft` term is TRL's: the token mean of the chosen completions' NLL over the whole micro-batch
    (sum of summed log-probs / sum of lengths), not a mean of per-pair means.
Traps pinned in the tests: TRL >= 0.29's `sigmoid` has no label smoothing (cDPO is `robust`-like only in old TRL
and LLaMA-Factory); TRL's ORPO NLL is a token-mean cross-entropy over the whole chosen sequence, prompt included
(`orpo_nll`), while LLaMA-Factory's is the completion's mean NLL; SimPO in TRL is `CPOTrainer(loss_type="simpo")`,
pure only with cpo_alpha 0 (default 1 adds a behaviour-cloning NLL).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from meshformer.config.preference_schema import DPO_LOSS_TYPES, KTO_LOSS_TYPES

# TRL 1.16 DPOConfig loss types built here, plus cdpo: the conservative sigmoid -(1-eps) log sig(z) - eps log sig(-z)
# that TRL <= 0.28, LLaMA-Factory and torchtune call "sigmoid" (TRL 1.16's sigmoid has no smoothing). Not built:
# aot / aot_unpaired (they sort log-ratios across the whole per-device batch, so their value depends on how a
# layout splits it) and f_divergence_type other than reverse_kl.
# The loss types built are the config's choices (config/preference_schema.py), cdpo among them
DISCOPOP_TAU = 0.05  # TRL DPOConfig.discopop_tau default


def token_logps(logits: torch.Tensor, input_ids: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """[B, L-1] log p(input_ids[:, t+1] | :t) in float32 (float64 stays), 0 where completion_mask[:, 1:] is 0: what
    TRL's fused LM head returns as `log_probs` for labels = input_ids masked to the completion."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logp = torch.log_softmax(logits[:, :-1].to(dtype), dim=-1)
    picked = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return picked * completion_mask[:, 1:].to(dtype)


def sequence_logps(
    logits: torch.Tensor, input_ids: torch.Tensor, completion_mask: torch.Tensor, average: bool = False
) -> torch.Tensor:
    """[B] summed (or, average=True, per-token mean) log-probability of each row's completion tokens."""
    per_token = token_logps(logits, input_ids, completion_mask)
    total = per_token.sum(-1)
    if not average:
        return total
    return total / completion_mask[:, 1:].sum(-1).to(total.dtype)


def orpo_nll(logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """TRL 1.16 ORPO's NLL term: cross-entropy averaged over every attended token of the chosen rows, PROMPT
    INCLUDED (orpo_trainer.py `concatenated_forward`: labels masked by attention only). LLaMA-Factory's `pref_ftx`
    style term is instead -sequence_logps(..., average=True) of the completion; pass whichever you mean."""
    mask = attention_mask[:, 1:].bool()
    per_token = token_logps(logits, input_ids, torch.ones_like(attention_mask))
    return -(per_token[mask]).mean()


def _pair_metrics(beta: float, chosen_logratios, rejected_logratios, chosen_logps, rejected_logps) -> dict:
    chosen_rewards = beta * chosen_logratios.detach()
    rejected_rewards = beta * rejected_logratios.detach()
    return {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).to(chosen_rewards.dtype).mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "logps/chosen": chosen_logps.detach().mean(),
        "logps/rejected": rejected_logps.detach().mean(),
    }


def _dpo_term(kind: str, beta: float, eps: float, rc, rr, lc, lr, chosen_logps):
    """Per-pair loss of one TRL loss type; rc, rr: log-ratios; lc, lr: completion lengths (clamped >= 1)."""
    z = beta * (rc - rr)
    if kind == "sigmoid":
        return -F.logsigmoid(z)
    if kind == "cdpo":
        return -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
    if kind == "hinge":
        return torch.relu(1 - z)
    if kind == "ipo":
        return (rc / lc - rr / lr - 1 / (2 * beta)) ** 2
    if kind == "robust":
        return (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)
    if kind == "exo_pair":
        eps_t = torch.tensor(eps, dtype=z.dtype, device=z.device)
        return torch.sigmoid(z) * (F.logsigmoid(z) - torch.log1p(-eps_t)) + torch.sigmoid(-z) * (
            F.logsigmoid(-z) - torch.log(eps_t)
        )
    if kind == "nca_pair":
        return -F.logsigmoid(beta * rc) - 0.5 * F.logsigmoid(-beta * rc) - 0.5 * F.logsigmoid(-beta * rr)
    if kind == "bco_pair":
        return -F.logsigmoid(beta * rc) - F.logsigmoid(-beta * rr)
    if kind == "sppo_hard":
        return (rc - 0.5 / beta) ** 2 + (rr + 0.5 / beta) ** 2
    if kind == "apo_zero":
        return 1 - torch.sigmoid(beta * rc) + torch.sigmoid(beta * rr)
    if kind == "apo_down":
        return torch.sigmoid(beta * rc) + 1 - torch.sigmoid(z)
    if kind == "discopop":
        mod = torch.sigmoid(z / DISCOPOP_TAU)
        return -F.logsigmoid(z) * (1 - mod) + torch.exp(-z) * mod
    if kind == "sigmoid_norm":
        return -F.logsigmoid(beta * (rc / lc - rr / lr))
    if kind == "sft":  # token mean over the micro-batch's chosen completions, the same for every pair
        return (-chosen_logps.sum() / lc.sum()).expand_as(rc)
    raise ValueError(f"unknown DPO loss type {kind!r}: one of {', '.join(DPO_LOSS_TYPES)}")


def dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float = 0.1,
    loss_type: str | tuple | list = "sigmoid",
    loss_weights: tuple | list | None = None,
    label_smoothing: float = 0.0,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """(loss, metrics) of TRL 1.16's DPOTrainer for [P] pairs of SUMMED completion log-probs. The lengths (completion
    tokens per pair) are needed by ipo, sigmoid_norm and sft. Returns the mean over pairs of the weighted sum of the
    loss types, and the per-pair loss as metrics["per_pair"] (for a step that normalises over several micro-batches;
    `sft`'s share is its micro-batch token mean, as in TRL)."""
    kinds = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    weights = [1.0] * len(kinds) if loss_weights is None else list(loss_weights)
    if len(weights) != len(kinds):
        raise ValueError(f"loss_weights has {len(weights)} entries for {len(kinds)} loss types")
    rc, rr = chosen_logps - ref_chosen_logps, rejected_logps - ref_rejected_logps
    ones = torch.ones_like(rc)
    lc = ones if chosen_lengths is None else chosen_lengths.to(rc.dtype).clamp(min=1.0)
    lr = ones if rejected_lengths is None else rejected_lengths.to(rc.dtype).clamp(min=1.0)
    if chosen_lengths is None and any(k in ("ipo", "sigmoid_norm", "sft") for k in kinds):
        raise ValueError("ipo, sigmoid_norm and sft need chosen_lengths and rejected_lengths")
    per_pair = torch.zeros_like(rc)
    loss = rc.new_zeros(())
    for kind, w in zip(kinds, weights):
        term = _dpo_term(kind, beta, label_smoothing, rc, rr, lc, lr, chosen_logps)
        per_pair = per_pair + w * term
        loss = loss + term.mean() * w
    metrics = _pair_metrics(beta, rc, rr, chosen_logps, rejected_logps)
    metrics["per_pair"] = per_pair
    return loss, metrics


def kto_kl_order(n: int) -> list[int]:
    """Which completion pairs with which prompt for KTO's KL estimate: completion i-1 for prompt i (the last for the
    first), TRL 1.16's rotation by one within the per-device batch."""
    return [n - 1, *range(n - 1)] if n else []


def kto_loss(
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
    labels: torch.Tensor,
    kl_logps: torch.Tensor | None,
    ref_kl_logps: torch.Tensor | None,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    loss_type: str = "kto",
) -> tuple[torch.Tensor, dict]:
    """(loss, metrics) of TRL 1.16's KTOTrainer for [N] examples of SUMMED completion log-probs; labels True for a
    desirable completion. z0 = mean(kl_logps - ref_kl_logps) over the mismatched pairs (kto_kl_order), detached and
    clamped >= 0 (pass None for both to skip it: z0 = 0, TRL's calculate_KL=False). Over several data-parallel
    ranks TRL averages z0's per-rank means before the clamp: pass the gathered means' mean as a 1-element
    kl_logps with ref_kl_logps zero."""
    if loss_type not in KTO_LOSS_TYPES:
        raise ValueError(f"unknown KTO loss type {loss_type!r}: one of {', '.join(KTO_LOSS_TYPES)}")
    labels = labels.to(torch.bool)
    z0 = logps.new_zeros(()) if kl_logps is None else (kl_logps - ref_kl_logps).mean().detach().clamp(min=0)
    ratios = logps - ref_logps
    rc, rr = ratios[labels], ratios[~labels]
    per_example = kto_per_example(ratios, labels, z0, beta, desirable_weight, undesirable_weight, loss_type)
    losses = torch.cat((per_example[labels], per_example[~labels]))
    metrics = {"kl": z0}
    n_c, n_r = int(labels.sum()), int((~labels).sum())
    if n_c:
        metrics["rewards/chosen"] = (beta * rc.detach()).nansum() / n_c
        metrics["logps/chosen"] = logps[labels].detach().nansum() / n_c
    if n_r:
        metrics["rewards/rejected"] = (beta * rr.detach()).nansum() / n_r
        metrics["logps/rejected"] = logps[~labels].detach().nansum() / n_r
    if n_c and n_r:
        metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    metrics["per_example"] = per_example
    return losses.nanmean(), metrics


def kto_per_example(
    ratios: torch.Tensor,
    desirable: torch.Tensor,
    z0: torch.Tensor,
    beta: float,
    desirable_weight: float,
    undesirable_weight: float,
    loss_type: str = "kto",
) -> torch.Tensor:
    """[N] each example's weighted KTO loss from its log-ratio (policy minus reference summed log-probability),
    its label (True: desirable) and z0; no host synchronisation (a step calls it per micro-batch)."""
    if loss_type == "kto":
        chosen, rejected = 1 - torch.sigmoid(beta * (ratios - z0)), 1 - torch.sigmoid(beta * (z0 - ratios))
    else:  # apo_zero_unpaired
        chosen, rejected = 1 - torch.sigmoid(beta * ratios), torch.sigmoid(beta * ratios)
    return torch.where(desirable, desirable_weight * chosen, undesirable_weight * rejected)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable on both sides of -log 2."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_log_odds(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor) -> torch.Tensor:
    """[P] log(odds(chosen) / odds(rejected)) of per-token MEAN log-probs, odds(p) = p / (1 - p)."""
    return (chosen_logps - rejected_logps) - (_log1mexp(chosen_logps) - _log1mexp(rejected_logps))


def orpo_loss(
    chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, nll: torch.Tensor, *, beta: float = 0.1
) -> tuple[torch.Tensor, dict]:
    """(loss, metrics) of TRL 1.16's ORPOTrainer for [P] pairs of per-token MEAN completion log-probs; `nll` is the
    SFT term (orpo_nll for TRL's, prompt included). loss = nll - beta * mean(log sigmoid(log odds ratio)), with the
    log odds computed in float32 as TRL does (float64 stays)."""
    dtype = torch.float64 if chosen_logps.dtype == torch.float64 else torch.float32
    c, r = chosen_logps.to(dtype), rejected_logps.to(dtype)
    log_odds = orpo_log_odds(c, r)
    ratio = F.logsigmoid(log_odds)
    loss = nll - (beta * ratio).mean()
    metrics = _pair_metrics(beta, c, r, c, r)
    metrics.update({"nll_loss": nll.detach(), "log_odds_ratio": ratio.mean(), "log_odds_chosen": log_odds.mean()})
    metrics["per_pair"] = nll.detach() - beta * ratio
    return loss, metrics


def simpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    *,
    beta: float = 0.1,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
    cpo_alpha: float = 0.0,
    nll: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """(loss, metrics) of TRL 1.16's CPOTrainer(loss_type="simpo") for [P] pairs of per-token MEAN completion
    log-probs: -(1-eps) log sig(beta d - gamma) - eps log sig(gamma - beta d), d = mean_c - mean_r; with cpo_alpha
    > 0 (CPO-SimPO) plus cpo_alpha * nll (TRL's: the chosen completions' token-mean NLL)."""
    logits = (chosen_logps - rejected_logps) - gamma / beta
    losses = -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing
    loss = losses.mean()
    if cpo_alpha:
        if nll is None:
            raise ValueError("cpo_alpha > 0 needs the chosen completions' NLL")
        loss = loss + cpo_alpha * nll
    metrics = _pair_metrics(beta, chosen_logps, rejected_logps, chosen_logps, rejected_logps)
    metrics["per_pair"] = losses
    return loss, metrics
