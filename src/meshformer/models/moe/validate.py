"""Cross-field rules of `model.model_config.moe_config` (`MoeModelConfig.validate`, models/moe/config.py, which
imports this module): one line each, before anything runs."""

from __future__ import annotations

from meshformer.errors import UserError

M = "model.model_config.moe_config"
# Load-balancing losses (models/moe/balance.py): where the router statistics come from.
AUX_LOSS_TYPES = ("global_batch", "sequence", "micro_batch")
# MindSpore Transformers' name of its expert-level balancing loss; meshformer computes it over the global batch.
AUX_LOSS_ALIASES = {"expert": "global_batch"}


def aux_losses(mc) -> dict[str, float]:
    """{loss type: coefficient} of the balancing losses configured (types resolved, zero coefficients dropped)."""
    m = mc.moe_config
    pairs = zip(m.aux_loss_types, m.aux_loss_factors) if m.aux_loss_types else [("global_batch", m.aux_loss_factor)]
    out: dict[str, float] = {}
    for kind, coef in pairs:
        kind = AUX_LOSS_ALIASES.get(kind, kind)
        if coef:
            out[kind] = out.get(kind, 0.0) + float(coef)
    return out


def validate_moe(mc, pipeline_stage: int = 1) -> None:
    m = mc.moe_config
    if not mc.is_moe:
        raise UserError(
            f"model.model_config.type={mc.type} is a Mixture-of-Experts model: set {M}.expert_num (> 1) and "
            f"num_experts_chosen, or import its config.json (meshformer import DIR)"
        )
    if m.num_experts_chosen > m.expert_num:
        raise UserError(f"{M}.num_experts_chosen={m.num_experts_chosen} exceeds expert_num={m.expert_num}")
    if m.expert_num % m.n_group:
        raise UserError(f"{M}.n_group={m.n_group} must divide expert_num={m.expert_num}")
    if m.topk_group > m.n_group:
        raise UserError(f"{M}.topk_group={m.topk_group} exceeds n_group={m.n_group}")
    per_group = m.expert_num // m.n_group
    if m.topk_method != "greedy" and m.n_group > 1 and m.num_experts_chosen > m.topk_group * per_group:
        raise UserError(
            f"{M}.num_experts_chosen={m.num_experts_chosen} is more than the {m.topk_group} x {per_group} experts "
            f"of the topk_group groups a token may use: raise topk_group"
        )
    if m.topk_method == "noaux_tc" and m.n_group > 1 and per_group < 2:
        raise UserError(
            f"{M}.topk_method=noaux_tc scores a group by its top two experts: n_group={m.n_group} "
            f"leaves {per_group} per group"
        )
    if len(m.aux_loss_types) != len(m.aux_loss_factors):
        raise UserError(
            f"{M}.aux_loss_types has {len(m.aux_loss_types)} entries and aux_loss_factors {len(m.aux_loss_factors)}: "
            f"give one coefficient per loss type"
        )
    for kind, coef in zip(m.aux_loss_types, m.aux_loss_factors):
        # a loss meshformer does not compute (MindSpore's device, comm) adds nothing at coefficient 0: accepted
        if AUX_LOSS_ALIASES.get(kind, kind) not in AUX_LOSS_TYPES and coef != 0:
            raise UserError(
                f"{M}.aux_loss_types: {kind!r} is not a balancing loss here: choose from {', '.join(AUX_LOSS_TYPES)} "
                f"(MindSpore's device and comm losses balance NPU links meshformer does not model)"
            )
    for f in m.aux_loss_factors:
        if not isinstance(f, (int, float)) or isinstance(f, bool) or f < 0:
            raise UserError(f"{M}.aux_loss_factors: {f!r} is not a non-negative number")
    if pipeline_stage > 1 and "global_batch" in aux_losses(mc):
        raise UserError(
            f"{M}: the global_batch balancing loss needs a routing pre-pass that pipeline parallelism cannot run "
            f"yet (pipeline_stage={pipeline_stage}): use aux_loss_types: [sequence] or balance_via_topk_bias"
        )
    bad = [i for i in m.mlp_only_layers if not isinstance(i, int) or not 0 <= i < mc.num_layers]
    if bad:
        raise UserError(f"{M}.mlp_only_layers: {bad} are not layer indices of the {mc.num_layers} layers")
    if not any(mc.is_moe_layer(i) for i in range(mc.num_layers)):
        raise UserError(
            f"{M}: no layer is sparse (first_k_dense_replace={m.first_k_dense_replace}, decoder_sparse_step="
            f"{m.decoder_sparse_step}, mlp_only_layers={m.mlp_only_layers}): the model would have no experts"
        )
