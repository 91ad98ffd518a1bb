"""DeepSeek-V2/V3's model config: multi-head latent attention's widths and ranks, the interleaved rotary layout of
its checkpoints and YaRN rotary scaling, on top of routed experts (models/moe/config.py). Only these types have
these fields: another family given one is refused at load, naming these types."""

from __future__ import annotations

from dataclasses import dataclass

from meshformer.config.fields import setting
from meshformer.config.model_schema import RopeScalingConfig, type_field
from meshformer.errors import UserError
from meshformer.models.moe.config import MOE_SHAPE_FIELDS, MoeModelConfig


@dataclass
class YarnRopeScalingConfig(RopeScalingConfig):
    type: str = setting(
        "none",
        "Rotary scaling: none, llama3 (Llama 3.1 frequency-dependent scaling) or yarn (DeepSeek-V2/V3).",
        choices=("none", "llama3", "yarn"),
    )
    beta_fast: float = setting(32.0, "yarn scaling: rotations below which frequencies are interpolated fully.", gt=0)
    beta_slow: float = setting(1.0, "yarn scaling: rotations above which frequencies are kept.", gt=0)
    mscale: float = setting(
        1.0,
        "yarn scaling: cos/sin x mscale(factor, mscale) / mscale(factor, mscale_all_dim), as HF (0: not given).",
        ge=0,
    )
    mscale_all_dim: float = setting(
        0.0, "yarn scaling: softmax scale x (0.1 mscale_all_dim ln(factor) + 1)^2 (DeepSeek; 0: none).", ge=0
    )


@dataclass
class DeepseekConfig(MoeModelConfig):
    """The fields of latent attention (mla.py) and YaRN (rope_yarn.py); `DeepseekV2Config` / `DeepseekV3Config` are
    its two types."""

    type: str = type_field("DeepseekV3Config")
    rope_scaling: YarnRopeScalingConfig = setting(
        YarnRopeScalingConfig, "Optional rotary frequency scaling (yarn for DeepSeek's long-context checkpoints)."
    )
    q_lora_rank: int | None = setting(
        None,
        "Latent attention: rank of the low-rank query projection (None: a full q_proj, as in V2-Lite).",
        gt=0,
    )
    kv_lora_rank: int | None = setting(
        None, "Latent attention (DeepSeek-V2/V3): rank of the compressed key/value (required).", gt=0
    )
    qk_rope_head_dim: int = setting(64, "Latent attention: per-head width of the rotary part of queries/keys.", gt=0)
    qk_nope_head_dim: int = setting(128, "Latent attention: per-head width of the part without rotary.", gt=0)
    v_head_dim: int = setting(128, "Latent attention: per-head width of the values.", gt=0)
    rope_interleave: bool = setting(
        False, "Rotary on interleaved pairs (x0,x1),(x2,x3)... as DeepSeek's checkpoints are laid out."
    )

    @property
    def qk_head_dim(self) -> int:
        """Per-head width of queries and keys under latent attention (no-rope part + rotary part)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def heads_are_dim_per_head(self) -> bool:
        return False  # q/k heads are qk_nope_head_dim + qk_rope_head_dim wide, values v_head_dim

    def validate(self, cfg) -> None:
        if self.kv_lora_rank is None:
            w = "model.model_config"
            raise UserError(f"{w}.type={self.type} uses latent attention: set {w}.kv_lora_rank (e.g. 512)")
        if self.qk_rope_head_dim % 2:
            # rotary turns pairs of channels; transformers' DeepSeek-V2/V3 cannot build an odd width either
            raise UserError(
                f"model.model_config.qk_rope_head_dim={self.qk_rope_head_dim} must be even (rotary embeddings turn "
                f"pairs of channels): use {self.qk_rope_head_dim - 1} or {self.qk_rope_head_dim + 1}"
            )
        super().validate(cfg)


@dataclass
class DeepseekV2Config(DeepseekConfig):
    type: str = type_field("DeepseekV2Config")


@dataclass
class DeepseekV3Config(DeepseekConfig):
    type: str = type_field("DeepseekV3Config")


CONFIG_CLASSES = {cls.__name__: cls for cls in (DeepseekV2Config, DeepseekV3Config)}
SHAPE_FIELDS = (
    "q_lora_rank",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "rope_interleave",
) + MOE_SHAPE_FIELDS
