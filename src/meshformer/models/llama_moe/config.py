"""The MoE Llama family's model configs: Llama attention's fields (models/llama/config.py) with routed experts
(`moe_config`, models/moe/config.py). Qwen2-MoE has q/k/v biases by default, Qwen3-MoE q/k norms."""

from __future__ import annotations

from dataclasses import dataclass

from meshformer.config.fields import setting
from meshformer.config.model_schema import type_field
from meshformer.models.llama.config import SHAPE_FIELDS as LLAMA_SHAPE_FIELDS
from meshformer.models.llama.config import LlamaConfig
from meshformer.models.moe.config import MOE_SHAPE_FIELDS, MoeModelConfig


@dataclass
class MixtralConfig(LlamaConfig, MoeModelConfig):
    type: str = type_field("MixtralConfig")


@dataclass
class Qwen2MoeConfig(LlamaConfig, MoeModelConfig):
    type: str = type_field("Qwen2MoeConfig")
    qkv_has_bias: bool = setting(True, "Add a bias to the q/k/v projections (Qwen2-MoE: on).")


@dataclass
class Qwen3MoeConfig(LlamaConfig, MoeModelConfig):
    type: str = type_field("Qwen3MoeConfig")
    use_qk_norm: bool = setting(True, "RMSNorm on each query and key head before rotary (Qwen3-MoE: on).")


CONFIG_CLASSES = {cls.__name__: cls for cls in (MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig)}
SHAPE_FIELDS = LLAMA_SHAPE_FIELDS + MOE_SHAPE_FIELDS
