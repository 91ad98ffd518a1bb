"""The Llama family (Llama 2/3, SmolLM2, Qwen2, Qwen3): its model (model.py), config.json
mapping (hf.py), GGUF names (gguf.py), MindSpore Transformers names (mindspore_names.py), and its entry in the
model-family registry."""

from meshformer.models.llama.activations import LLAMA_ACTIVATIONS
from meshformer.models.llama.config import CONFIG_CLASSES, SHAPE_FIELDS, LlamaConfig, Qwen2Config, Qwen3Config
from meshformer.models.llama.gguf import GGUF_NAMES
from meshformer.models.llama.hf import HF_MODEL_TYPES, config_from_hf, config_to_hf
from meshformer.models.llama.mindspore_names import from_mindspore, mindspore_name, to_mindspore
from meshformer.models.llama.model import (
    MLP,
    Attention,
    DecoderLayer,
    KVCache,
    RMSNorm,
    RopeTables,
    Transformer,
    apply_rotary,
    document_layout,
    document_positions,
    num_params,
    param_count,
    rope_cos_sin,
    rope_inv_freq,
    tp_plan,
)
from meshformer.models.registry import MindSporeNames, ModelFamily, register_family

LLAMA = ModelFamily(
    name="llama",
    config_types=CONFIG_CLASSES,
    hf_model_types=HF_MODEL_TYPES,
    build=Transformer,
    tp_plan=tp_plan,
    param_count=param_count,
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    gguf_names=GGUF_NAMES,
    activation_model=LLAMA_ACTIVATIONS,
    mindspore_names=MindSporeNames(from_mindspore, to_mindspore, mindspore_name),
    shape_fields=SHAPE_FIELDS,
    cp_attention={Attention: {"attend": "attend"}},
)
register_family(LLAMA)

__all__ = [
    "LLAMA",
    "MLP",
    "Attention",
    "DecoderLayer",
    "KVCache",
    "LlamaConfig",
    "Qwen2Config",
    "Qwen3Config",
    "RMSNorm",
    "RopeTables",
    "Transformer",
    "apply_rotary",
    "document_layout",
    "document_positions",
    "num_params",
    "param_count",
    "rope_cos_sin",
    "rope_inv_freq",
    "tp_plan",
]
