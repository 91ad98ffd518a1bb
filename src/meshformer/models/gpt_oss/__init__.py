"""The GPT-OSS family: Llama's decoder with biased attention, learned sinks, sliding windows on alternate layers and
an MoE block with biased experts and the clamped SwiGLU on every layer (model.py), its config (config.py),
config.json and tensor mapping (hf.py) and its registry entry; FLOPs and the KV cache follow each layer's
`window_of`."""

from meshformer.models.gpt_oss.config import CONFIG_CLASSES, SHAPE_FIELDS, GptOssConfig
from meshformer.models.gpt_oss.hf import (
    HF_MODEL_TYPES,
    config_from_hf,
    config_to_hf,
    from_hf,
    from_hf_tensors,
    to_hf,
    to_hf_tensors,
)
from meshformer.models.gpt_oss.model import GptOssDecoderLayer, GptOssTransformer, param_count, tp_plan
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

__all__ = ["GPT_OSS", "GptOssConfig", "GptOssDecoderLayer", "GptOssTransformer"]
