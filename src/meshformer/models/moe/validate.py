"""Cross-field rules of `model.model_config.moe_config` (`MoeModelConfig.validate`, models/moe/config.py, which
imports this module): one line each, before anything runs."""

from __future__ import annotations

from meshformer.errors import UserError

M = "model.model_config.moe_config"
# Load-balancing losses (models/moe/balance.py): where the router statistics come from.
AUX_LOSS_TYPES = ("global_batch", "sequence", "micro_batch")
# MindSpore Transformers' name of its expert-level balancing loss; meshformer computes it over the global batch.
AUX_LOSS_ALIASES = {"expert": "global_batch"}
# torch._grouped_mm (torch 2.13.0, CPU and CUDA) needs every matrix's rows 16-byte aligned ("strides should be
# multiple of 16 bytes"); use_gmm auto checks the same per call and loops over the experts instead
# (backends/torch_private.py grouped_mm_supported), an explicit use_gmm: true is checked here.
GROUPED_MM_ALIGN_BYTES = 16


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


def check_grouped_widths(mc) -> None:
    """use_gmm: true runs torch's grouped matmul on every routed expert: its widths must be 16-byte multiples in the
    dtype the experts compute in."""
    size = 4 if mc.compute_dtype == "float32" else 2
    step = GROUPED_MM_ALIGN_BYTES // size
    ffn_field = (
        f"{M}.moe_intermediate_size" if mc.moe_config.moe_intermediate_size else "model.model_config.intermediate_size"
    )
    widths = (("model.model_config.hidden_size", mc.hidden_size), (ffn_field, mc.expert_ffn_size))
    for field, width in widths:
        if width % step:
            raise UserError(
                f"{M}.use_gmm=true but {field}={width} is not a width torch's grouped matmul takes in "
                f"{mc.compute_dtype} (rows must be multiples of 16 bytes: float32 widths a multiple of 4, bfloat16 "
                f"and float16 a multiple of 8): choose such a width, or leave use_gmm out (grouped matmuls where "
                f"they run, else one expert after another)"
            )


def validate_moe(mc, pipeline_stage: int = 1) -> None:
    m = mc.moe_config
    if not mc.is_moe:
        raise UserError(
            f"model.model_config.type={mc.type} is a Mixture-of-Experts model: set {M}.expert_num (> 1) and "
            f"num_experts_chosen, or import its config.json (meshformer import DIR)"
        )
    if m.use_gmm:
        check_grouped_widths(mc)
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
    if not mc.moe_layer_count:
        raise UserError(
            f"{M}: no layer is sparse (first_k_dense_replace={m.first_k_dense_replace}, decoder_sparse_step="
            f"{m.decoder_sparse_step}, mlp_only_layers={m.mlp_only_layers}): the model would have no experts"
        )
