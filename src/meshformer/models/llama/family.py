"""The Llama family's entry in the model-family registry (models/registry.py `BUILTIN_FAMILIES` names the
folder; the registry imports this module on first use)."""

from meshformer.models.llama.activations import LLAMA_ACTIVATIONS
from meshformer.models.llama.config import CONFIG_CLASSES, SHAPE_FIELDS
from meshformer.models.llama.gguf import GGUF_NAMES
from meshformer.models.llama.hf import HF_MODEL_TYPES, config_from_hf, config_to_hf
from meshformer.models.llama.mindspore_names import from_mindspore, mindspore_name, to_mindspore
from meshformer.models.llama.model import (
    Attention,
    Transformer,
    param_count,
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
