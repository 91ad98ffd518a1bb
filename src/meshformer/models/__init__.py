"""Model definitions: plain nn.Modules with no parallel code, one folder per family, found through the registry.

Importing this package registers the built-in families (models/llama/, models/llama_moe/, models/deepseek/,
models/mistral/, models/gpt_oss/, models/glm4/,
models/gemma3/)."""

from meshformer.models import llama, llama_moe, deepseek, mistral, gpt_oss, glm4, gemma3  # noqa: F401, I001  (register the families, in this order)
from meshformer.models.init import build_model, create_model, init_weights, materialize
from meshformer.models.llama import KVCache, Transformer, num_params
from meshformer.models.registry import ModelFamily, families, family_for_hf, family_of, register_family

__all__ = [
    "Transformer",
    "KVCache",
    "ModelFamily",
    "build_model",
    "create_model",
    "families",
    "family_for_hf",
    "family_of",
    "init_weights",
    "materialize",
    "num_params",
    "register_family",
]
