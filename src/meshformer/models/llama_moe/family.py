"""The MoE Llama family's entry in the model-family registry (models/registry.py `BUILTIN_FAMILIES` names the
folder; the registry imports this module on first use)."""

from meshformer.models.llama.model import Attention
from meshformer.models.llama_moe.config import CONFIG_CLASSES, SHAPE_FIELDS
from meshformer.models.llama_moe.hf import (
    HF_MODEL_TYPES,
    config_from_hf,
    config_to_hf,
    from_hf,
    from_hf_tensors,
    to_hf_for,
)
from meshformer.models.llama_moe.model import MoeTransformer, param_count, tp_plan
from meshformer.models.registry import ModelFamily, register_family

LLAMA_MOE = ModelFamily(
    name="llama_moe",
    config_types=CONFIG_CLASSES,
    hf_model_types=HF_MODEL_TYPES,
    build=MoeTransformer,
    tp_plan=tp_plan,
    param_count=param_count,
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    from_hf=from_hf,
    from_hf_tensors=from_hf_tensors,
    to_hf_for=to_hf_for,
    moe=True,
    shape_fields=SHAPE_FIELDS,
    cp_attention={Attention: {"attend": "attend"}},
)
register_family(LLAMA_MOE)
