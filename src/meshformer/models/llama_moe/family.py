"""The MoE Llama family's entry in the model-family registry: what its folder's modules do not say by their names."""

from meshformer.models.llama.model import CP_ATTENTION
from meshformer.models.llama_moe import config, hf, model
from meshformer.models.registry import folder_family, register_family

LLAMA_MOE = folder_family("llama_moe", model.MoeTransformer, config, hf, model, moe=True, cp_attention=CP_ATTENTION)
register_family(LLAMA_MOE)
