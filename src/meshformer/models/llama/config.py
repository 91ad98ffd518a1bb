"""The Llama family's model configs: `LlamaConfig` and the two Qwen variants, whose defaults differ (Qwen2's q/k/v
biases, Qwen3's q/k norms). MindSpore Transformers names its types the same way, so `model_config.type` is the
class's name."""

from __future__ import annotations

from dataclasses import dataclass

from meshformer.config.fields import setting
from meshformer.config.model_schema import ModelConfig, type_field


@dataclass
class LlamaConfig(ModelConfig):
    """Llama 2/3/3.1, SmolLM2; the base of the Qwen variants and the MoE Llama family."""

    type: str = type_field("LlamaConfig")
    qkv_has_bias: bool = setting(False, "Add a bias to the q/k/v projections (Qwen2).")
    use_qk_norm: bool = setting(False, "RMSNorm on each query and key head before rotary (Qwen3).")


@dataclass
class Qwen2Config(LlamaConfig):
    type: str = type_field("Qwen2Config")
    qkv_has_bias: bool = setting(True, "Add a bias to the q/k/v projections (Qwen2: on).")


@dataclass
class Qwen3Config(LlamaConfig):
    type: str = type_field("Qwen3Config")
    use_qk_norm: bool = setting(True, "RMSNorm on each query and key head before rotary (Qwen3: on).")


CONFIG_CLASSES = {cls.__name__: cls for cls in (LlamaConfig, Qwen2Config, Qwen3Config)}
# The fields of this family's own a fine-tune takes from its base model (train/finetune.py adds the common ones).
SHAPE_FIELDS = ("qkv_has_bias", "use_qk_norm")
