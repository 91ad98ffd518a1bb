"""Model definitions: plain nn.Modules with no parallel code."""

from meshformer.models.init import build_model, create_model, init_weights, materialize
from meshformer.models.llama import KVCache, Transformer, num_params

__all__ = ["Transformer", "KVCache", "build_model", "create_model", "init_weights", "materialize", "num_params"]
