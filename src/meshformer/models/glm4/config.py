"""GLM-4's model config: Llama's fields (models/llama/config.py) with q/k/v biases on by default and the fraction of
each head the rotary embedding turns (`partial_rotary_factor`; GLM-4 turns half)."""

from __future__ import annotations

from dataclasses import dataclass

from meshformer.config.fields import setting
from meshformer.config.model_schema import type_field
from meshformer.errors import UserError
from meshformer.models.llama.config import LlamaConfig


def rotary_width(mc) -> int:
    """Channels of each head the rotary embedding turns: the first int(head_dim x partial_rotary_factor), as
    transformers' Glm4RotaryEmbedding counts them."""
    return int(mc.dim_per_head * mc.partial_rotary_factor)


@dataclass
class Glm4Config(LlamaConfig):
    """GLM-4-0414 (Hugging Face `glm4`): Llama's decoder with a rotary embedding on the first fraction of each head
    (adjacent pairs), a norm after attention and after the MLP, and q/k/v biases."""

    # MindSpore Transformers' Glm4Config (mindformers/models/glm4/configuration_glm4.py) spells its fields as
    # transformers does: those whose names differ from meshformer's are aliases here, so its YAML loads as it is.
    type: str = type_field("Glm4Config")
    num_layers: int = setting(32, "Number of decoder layers.", gt=0, aliases=("num_hidden_layers",))
    num_heads: int = setting(
        32, "Attention (query) heads; model_parallel must divide it.", gt=0, aliases=("num_attention_heads",)
    )
    n_kv_heads: int | None = setting(
        None,
        "Key/value heads for grouped-query attention (default: num_heads).",
        gt=0,
        aliases=("num_key_value_heads",),
    )
    theta: float = setting(10000.0, "Rotary embedding base frequency.", gt=0, aliases=("rotary_emb_base", "rope_theta"))
    qkv_has_bias: bool = setting(True, "Add a bias to the q/k/v projections (GLM-4: on).", aliases=("attention_bias",))
    partial_rotary_factor: float = setting(
        0.5, "Fraction of each head's channels the rotary embedding turns (the first ones; GLM-4: 0.5).", gt=0, le=1
    )

    def validate(self, cfg) -> None:
        width = rotary_width(self)
        if width < 2 or width % 2:
            raise UserError(
                f"model.model_config.partial_rotary_factor={self.partial_rotary_factor} turns {width} of head_dim="
                f"{self.dim_per_head} channels: rotary pairs need an even number, at least 2 (choose a factor giving "
                f"an even width, e.g. 0.5 with an even head_dim / 2)"
            )
        if self.use_qk_norm:
            raise UserError("model.model_config.use_qk_norm=True: GLM-4 has no q/k norms (set it false)")
        self.refuse_rope_scaling("GLM-4's partial rotary is not scaled in meshformer (set rope_scaling.type: none)")
        super().validate(cfg)


CONFIG_CLASSES = {"Glm4Config": Glm4Config}
# The fields of this family's own a fine-tune takes from its base model
SHAPE_FIELDS = ("qkv_has_bias", "partial_rotary_factor")
