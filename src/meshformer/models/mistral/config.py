"""Mistral's model config: Llama's fields (models/llama/config.py) and the sliding window every layer applies."""

from __future__ import annotations

from dataclasses import dataclass

from meshformer.config.fields import setting
from meshformer.config.model_schema import type_field
from meshformer.errors import UserError
from meshformer.models.llama.config import LlamaConfig


@dataclass
class MistralConfig(LlamaConfig):
    """Mistral 7B and its kin: Llama's decoder whose every attention layer sees a sliding window of keys."""

    type: str = type_field("MistralConfig")
    sliding_window: int | None = setting(
        None, "Keys each query attends, itself included (Mistral's sliding window; None: global attention).", gt=0
    )

    def window_of(self, layer: int) -> int | None:
        return self.sliding_window  # every layer's

    def validate(self, cfg) -> None:
        if self.qkv_has_bias or self.use_qk_norm:
            raise UserError(
                f"model.model_config.type=MistralConfig with qkv_has_bias={self.qkv_has_bias}, use_qk_norm="
                f"{self.use_qk_norm}: Mistral has neither (use LlamaConfig, Qwen2Config or Qwen3Config)"
            )
        super().validate(cfg)


CONFIG_CLASSES = {"MistralConfig": MistralConfig}
# The field of this family's own a fine-tune takes from its base model (Llama's are false for Mistral)
SHAPE_FIELDS = ("sliding_window",)
