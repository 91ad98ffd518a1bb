"""GPT-OSS's model config: Llama's fields (q/k/v biases on) with routed experts on every layer (models/moe/config.py),
the sliding window its `layer_types` apply per layer, and YaRN rotary scaling as GPT-OSS configures it."""

from __future__ import annotations

from dataclasses import dataclass

from meshformer.config.fields import setting
from meshformer.config.model_schema import RopeScalingConfig, type_field
from meshformer.errors import UserError
from meshformer.models.llama.config import LlamaConfig
from meshformer.models.moe.config import MOE_SHAPE_FIELDS, MoeConfig, MoeModelConfig

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass
class GptOssRopeScalingConfig(RopeScalingConfig):
    type: str = setting("none", "Rotary scaling: none, or yarn (GPT-OSS's).", choices=("none", "yarn"))
    beta_fast: float = setting(32.0, "yarn scaling: rotations below which frequencies are interpolated fully.", gt=0)
    beta_slow: float = setting(1.0, "yarn scaling: rotations above which frequencies are kept.", gt=0)
    yarn_truncate: bool = setting(
        False, "yarn scaling: round the ramp's correction dimensions outwards (GPT-OSS: false, transformers: true)."
    )


@dataclass
class GptOssMoeConfig(MoeConfig):
    """moe_config with GPT-OSS's routing and experts as defaults: a biased router, top-4 renormalised (softmax over
    the chosen logits), biased experts with the clamped SwiGLU."""

    expert_num: int = setting(128, "Routed experts per MoE layer (GPT-OSS 20B: 32, 120B: 128).", ge=1)
    num_experts_chosen: int = setting(4, "Experts each token is routed to (top-k).", ge=1)
    router_bias: bool = setting(True, "The router's linear has a bias per expert (GPT-OSS: on).")
    expert_bias: bool = setting(True, "The routed experts' projections have biases (GPT-OSS: on).")
    expert_activation: str = setting(
        "clamped_swiglu",
        "Routed experts' gated activation (GPT-OSS: clamped_swiglu).",
        choices=("silu", "clamped_swiglu"),
    )


@dataclass
class GptOssConfig(LlamaConfig, MoeModelConfig):
    """GPT-OSS (gpt-oss-20b / 120b): biased attention with learned sinks, alternating sliding and full layers, and
    a Mixture-of-Experts block on every layer."""

    type: str = type_field("GptOssConfig")
    qkv_has_bias: bool = setting(True, "Add a bias to the q/k/v projections (GPT-OSS: on; o_proj has one too).")
    rope_scaling: GptOssRopeScalingConfig = setting(GptOssRopeScalingConfig, "Optional rotary scaling (yarn).")
    moe_config: GptOssMoeConfig = setting(GptOssMoeConfig, "Mixture-of-Experts: experts, routing, balancing.")
    sliding_window: int | None = setting(
        128, "Keys each query of a sliding_attention layer attends, itself included (None: global).", gt=0
    )
    layer_types: list = setting(
        [], "Per layer sliding_attention or full_attention (default: sliding on even layers, as Hugging Face)."
    )

    def window_of(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (None: global attention)."""
        types = self.layer_types or [LAYER_TYPES[i % 2] for i in range(self.num_layers)]
        sliding = types[layer] == "sliding_attention" if layer < len(types) else layer % 2 == 0
        return self.sliding_window if sliding else None

    def validate(self, cfg) -> None:
        where = "model.model_config"
        if self.layer_types and (
            len(self.layer_types) != self.num_layers or any(t not in LAYER_TYPES for t in self.layer_types)
        ):
            raise UserError(
                f"{where}.layer_types={self.layer_types}: give one of {' / '.join(LAYER_TYPES)} for each of the "
                f"{self.num_layers} layers, or leave it empty (alternating, sliding first)"
            )
        if self.use_qk_norm:
            raise UserError(f"{where}.use_qk_norm=true: GPT-OSS has no q/k norm (set it false)")
        m = self.moe_config
        if m.expert_num < 2:
            raise UserError(f"{where}.moe_config.expert_num={m.expert_num}: GPT-OSS routes to experts (at least 2)")
        dense = {"first_k_dense_replace": m.first_k_dense_replace, "decoder_sparse_step": m.decoder_sparse_step - 1}
        dense |= {"mlp_only_layers": m.mlp_only_layers, "shared_expert_num": m.shared_expert_num}
        for key, value in dense.items():
            if value:
                raise UserError(
                    f"{where}.moe_config.{key} is set: every GPT-OSS layer is an MoE block with no shared expert "
                    f"(leave it at its default)"
                )
        super().validate(cfg)


CONFIG_CLASSES = {"GptOssConfig": GptOssConfig}
# The fields of this family's own a fine-tune takes from its base model
SHAPE_FIELDS = ("qkv_has_bias", "sliding_window", "layer_types", *MOE_SHAPE_FIELDS)
