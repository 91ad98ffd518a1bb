"""`model.model_config.moe_config`: the Mixture-of-Experts part of a model, in MindSpore Transformers' names, and
`MoeModelConfig`, the base of every config class whose family builds routed experts (models/llama_moe/,
models/deepseek/): only those classes have a `moe_config` field, so a dense type refuses one.

MindSpore Transformers writes `moe_config` at the top level of its YAML files; config/load.py moves it here, under
the model it describes, so a family builds from one model config. Which layers are sparse, how tokens are routed and
how the load is balanced are all here; how experts are split over devices is `parallel_config.expert_parallel`.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshformer.config.fields import setting
from meshformer.config.model_schema import ModelConfig
from meshformer.models.moe.validate import validate_moe

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


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
    router_bias: bool = setting(False, "The router's linear has a bias per expert (GPT-OSS).")
    expert_bias: bool = setting(False, "The routed experts' gate, up and down projections have biases (GPT-OSS).")
    expert_activation: str = setting(
        "silu",
        "Routed experts' gated activation: silu (SwiGLU), or clamped_swiglu ((up + 1) x gate x sigmoid(alpha x gate), "
        "gate clamped above and up both ways at swiglu_limit: GPT-OSS).",
        choices=("silu", "clamped_swiglu"),
    )
    swiglu_alpha: float = setting(1.702, "clamped_swiglu: the sigmoid's gain alpha.", gt=0)
    swiglu_limit: float = setting(7.0, "clamped_swiglu: the clamp of gate (from above) and up (both ways).", gt=0)
    use_gmm: bool | None = setting(
        None, "Routed experts by grouped matmuls (true) or a per-expert loop (false); default: grouped where it runs."
    )


# moe_config fields that shape the network (which layers have experts, how many, how tokens are routed): a fine-tune
# takes them from its base model (train/finetune.py); the balancing losses, capacity and the bias update stay the
# run's, like the dtypes.
MOE_SHAPE_FIELDS = tuple(
    f"moe_config.{name}"
    for name in (
        "expert_num",
        "num_experts_chosen",
        "moe_intermediate_size",
        "shared_expert_num",
        "shared_expert_intermediate_size",
        "shared_expert_gate",
        "use_gating_sigmoid",
        "topk_method",
        "n_group",
        "topk_group",
        "norm_topk_prob",
        "routed_scaling_factor",
        "first_k_dense_replace",
        "decoder_sparse_step",
        "mlp_only_layers",
        "router_bias",
        "expert_bias",
        "expert_activation",
        "swiglu_alpha",
        "swiglu_limit",
    )
)


@dataclass
class MoeModelConfig(ModelConfig):
    """A model config with routed experts: the MoE families' classes extend it (with their attention's fields)."""

    moe_config: MoeConfig = setting(
        MoeConfig, "Mixture-of-Experts: experts, routing, balancing (MindSpore's top-level moe_config lands here)."
    )

    @property
    def is_moe(self) -> bool:
        """The model has routed experts (moe_config.expert_num > 1)."""
        return self.moe_config.expert_num > 1

    def is_moe_layer(self, index: int) -> bool:
        """Layer `index` has a Mixture-of-Experts block instead of a dense MLP: DeepSeek's first_k_dense_replace
        and Qwen-MoE's decoder_sparse_step / mlp_only_layers together."""
        m = self.moe_config
        return (
            self.is_moe
            and index >= m.first_k_dense_replace
            and index not in m.mlp_only_layers
            and (index + 1) % m.decoder_sparse_step == 0
        )

    @property
    def moe_layer_count(self) -> int:
        """How many layers `is_moe_layer` calls sparse, counted without visiting them (a num_layers typo of a
        billion must not loop a billion times)."""
        if not self.is_moe:
            return 0
        m = self.moe_config
        first, step, n = m.first_k_dense_replace, m.decoder_sparse_step, self.num_layers
        if first >= n or step < 1:
            return 0
        listed = {i for i in m.mlp_only_layers if isinstance(i, int) and first <= i < n and (i + 1) % step == 0}
        return n // step - first // step - len(listed)  # (i + 1) a multiple of step, for i in [first, n)

    @property
    def expert_ffn_size(self) -> int:
        """Hidden width of one routed expert: moe_intermediate_size, else the dense MLP's."""
        return self.moe_config.moe_intermediate_size or self.ffn_hidden_size

    @property
    def shared_ffn_size(self) -> int:
        """Hidden width of the shared experts' MLP (0: none)."""
        m = self.moe_config
        if m.shared_expert_intermediate_size:
            return m.shared_expert_intermediate_size
        return m.shared_expert_num * self.expert_ffn_size

    def validate(self, cfg) -> None:
        super().validate(cfg)
        validate_moe(self, cfg.parallel_config.pipeline_stage)
