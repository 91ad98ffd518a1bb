"""The MoE Llama family (Mixtral, Qwen2-MoE, Qwen3-MoE): Llama attention with Mixture-of-Experts blocks (model.py),
its config.json and per-expert tensor names (hf.py), and its entry in the model-family registry.

Importing the package imports none of them (no torch): its attributes load on first use (models/lazy.py)."""

from meshformer.models.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__, family=("LLAMA_MOE",), model=("MoeDecoderLayer", "MoeTransformer", "param_count", "tp_plan")
)
