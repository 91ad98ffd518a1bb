"""`model.model_config.moe_config`: the Mixture-of-Experts part of a model, in MindSpore Transformers' names.

MindSpore Transformers writes `moe_config` at the top level of its YAML files; config/load.py moves it here, under
the model it describes, so a family builds from one ModelConfig. Which layers are sparse, how tokens are routed and
how the load is balanced are all here; how experts are split over devices is `parallel_config.expert_parallel`.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshformer.config.fields import setting

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
# Load-balancing losses (models/moe/balance.py): where the router statistics come from.
AUX_LOSS_TYPES = ("global_batch", "sequence", "micro_batch")


@dataclass
class MoeConfig:
    expert_num: int = setting(1, "Routed experts per MoE layer (1: a dense model).", ge=1)
    num_experts_chosen: int = setting(1, "Experts each token is routed to (top-k).", ge=1)
    moe_intermediate_size: int | None = setting(
        None, "Hidden width of each routed expert (default: model_config.intermediate_size).", gt=0
    )
    shared_expert_num: int = setting(0, "Shared experts every token also passes through (DeepSeek).", ge=0)
    shared_expert_intermediate_size: int | None = setting(
        None, "Width of the shared experts' MLP (Qwen2-MoE; default shared_expert_num x moe_intermediate_size).", gt=0
    )
    shared_expert_gate: bool = setting(False, "Scale shared experts' output by a per-token sigmoid gate (Qwen2-MoE).")
    use_gating_sigmoid: bool = setting(False, "Router scores by sigmoid (DeepSeek-V3) instead of softmax.")
    topk_method: str = setting(
        "greedy",
        "greedy: top-k of all experts; group_limited_greedy: top groups by their best expert (V2); noaux_tc: by their "
        "top-2 sum with the bias (V3).",
        choices=TOPK_METHODS,
    )
    n_group: int = setting(1, "Expert groups for group-limited routing (must divide expert_num).", ge=1)
    topk_group: int = setting(1, "Groups a token may choose experts from (group-limited routing).", ge=1)
    norm_topk_prob: bool = setting(True, "Renormalise the chosen experts' weights to sum to 1 (Mixtral always does).")
    routed_scaling_factor: float = setting(1.0, "Multiply the routed experts' weights by this (DeepSeek).", gt=0)
    first_k_dense_replace: int = setting(0, "The first k decoder layers keep a dense MLP (DeepSeek).", ge=0)
    decoder_sparse_step: int = setting(1, "Layer i is sparse when (i + 1) % decoder_sparse_step == 0 (Qwen-MoE).", ge=1)
    mlp_only_layers: list = setting([], "Layer indices that keep a dense MLP (Qwen-MoE).")
    capacity_factor: float | None = setting(
        None,
        "Tokens an expert takes: factor x routed tokens / experts per micro-batch; the lowest-weight overflow is "
        "dropped. None: no token dropped.",
        gt=0,
    )
    aux_loss_types: list = setting(
        [], "Load-balancing losses: global_batch (f.P over the whole batch), sequence (DeepSeek-V3), micro_batch (HF)."
    )
    aux_loss_factors: list = setting([], "Coefficient of each of aux_loss_types, in the same order.")
    aux_loss_factor: float = setting(
        0.0, "Coefficient of the global_batch balancing loss when aux_loss_types is not given.", ge=0
    )
    z_loss_factor: float = setting(0.0, "Router z-loss coefficient (mean squared logsumexp of router logits).", ge=0)
    balance_via_topk_bias: bool = setting(
        False, "Auxiliary-loss-free balancing: after each step move the routing bias by rate x sign(mean load - load)."
    )
    topk_bias_update_rate: float = setting(0.001, "Step of the routing-bias update (balance_via_topk_bias).", ge=0)
    use_gmm: bool | None = setting(
        None, "Routed experts by grouped matmuls (true) or a per-expert loop (false); default: grouped where it runs."
    )
