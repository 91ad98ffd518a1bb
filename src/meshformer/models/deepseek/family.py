"""The DeepSeek family's entry in the model-family registry: what its folder's modules do not say by their names
(latent attention's FLOPs, KV cache and context parallelism: capabilities.py)."""

from meshformer.models.deepseek import capabilities, config, hf, model
from meshformer.models.deepseek.mla import LatentAttention
from meshformer.models.registry import folder_family, register_family

DEEPSEEK = folder_family(
    "deepseek",
    model.DeepseekTransformer,
    config,
    hf,
    model,
    moe=True,
    attention_cost=capabilities.attention_cost,
    kv_cache_width=capabilities.latent_width,
    cp_attention={LatentAttention: {"gather_latent": "gather", "attend": "attend_gathered"}},
    cp_gather_width=capabilities.latent_width,
    cp_saved_bytes=capabilities.cp_saved_bytes,
)
register_family(DEEPSEEK)
