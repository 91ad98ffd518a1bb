"""The GPT-OSS family's entry in the model-family registry: what its folder's modules do not say by their names."""

from meshformer.models.gpt_oss import config, hf, model
from meshformer.models.llama.model import CP_ATTENTION
from meshformer.models.registry import folder_family, register_family

# activation_model None: the planner counts activations on the real modules (planner/counted_activations.py: the
# banded masks, the sinks' extra key and the routed experts' closed form)
GPT_OSS = folder_family(
    "gpt_oss", model.GptOssTransformer, config, hf, model, moe=True, activation_model=None, cp_attention=CP_ATTENTION
)
register_family(GPT_OSS)
