"""The GPT-OSS family's entry in the model-family registry (models/registry.py `BUILTIN_FAMILIES` names the
folder; the registry imports this module on first use)."""

from meshformer.models.gpt_oss.config import CONFIG_CLASSES, SHAPE_FIELDS
from meshformer.models.gpt_oss.hf import (
    HF_MODEL_TYPES,
    config_from_hf,
    config_to_hf,
    from_hf,
    from_hf_tensors,
    to_hf,
    to_hf_tensors,
)
from meshformer.models.gpt_oss.model import GptOssTransformer, param_count, tp_plan
from meshformer.models.llama.model import Attention
from meshformer.models.registry import ModelFamily, register_family

GPT_OSS = ModelFamily(
    name="gpt_oss",
    config_types=CONFIG_CLASSES,
    hf_model_types=HF_MODEL_TYPES,
    build=GptOssTransformer,
    tp_plan=tp_plan,
    param_count=param_count,
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    to_hf=to_hf,
    from_hf=from_hf,
    from_hf_tensors=from_hf_tensors,
    to_hf_tensors=to_hf_tensors,
    moe=True,
    # None: the planner counts activations on the real modules (planner/counted_activations.py: the banded masks,
    # the sinks' extra key and the routed experts' closed form)
    activation_model=None,
    shape_fields=SHAPE_FIELDS,
    cp_attention={Attention: {"attend": "attend"}},
)
register_family(GPT_OSS)
