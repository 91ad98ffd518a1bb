"""The DeepSeek family's entry in the model-family registry (models/registry.py `BUILTIN_FAMILIES` names the
folder; the registry imports this module on first use)."""

from meshformer.models.deepseek import capabilities
from meshformer.models.deepseek.config import CONFIG_CLASSES, SHAPE_FIELDS
from meshformer.models.deepseek.hf import (
    HF_MODEL_TYPES,
    config_from_hf,
    config_to_hf,
    from_hf_tensors,
    to_hf_tensors,
)
from meshformer.models.deepseek.mla import LatentAttention
from meshformer.models.deepseek.model import DeepseekTransformer, param_count, tp_plan
from meshformer.models.registry import ModelFamily, register_family

DEEPSEEK = ModelFamily(
    name="deepseek",
    config_types=CONFIG_CLASSES,
    hf_model_types=HF_MODEL_TYPES,
    build=DeepseekTransformer,
    tp_plan=tp_plan,
    param_count=param_count,
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    from_hf_tensors=from_hf_tensors,
    to_hf_tensors=to_hf_tensors,
    moe=True,
    shape_fields=SHAPE_FIELDS,
    attention_cost=capabilities.attention_cost,
    kv_cache_width=capabilities.latent_width,
    cp_attention={LatentAttention: {"gather_latent": "gather", "attend": "attend_gathered"}},
    cp_gather_width=capabilities.latent_width,
    cp_saved_bytes=capabilities.cp_saved_bytes,
)
register_family(DEEPSEEK)
