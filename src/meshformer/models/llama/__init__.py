"""The Llama family (Llama 2/3, SmolLM2, Qwen2, Qwen3): its model (model.py), config.json
mapping (hf.py), GGUF names (gguf.py), MindSpore Transformers names (mindspore_names.py), and its entry in the
model-family registry.

Importing the package imports none of them (no torch): its attributes load on first use (models/lazy.py)."""

from meshformer.models.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    family=("LLAMA",),
    config=("LlamaConfig", "Qwen2Config", "Qwen3Config"),
    model=(
        "MLP",
        "Attention",
        "DecoderLayer",
        "KVCache",
        "RMSNorm",
        "RopeTables",
        "Transformer",
        "apply_rotary",
        "document_layout",
        "document_positions",
        "num_params",
        "param_count",
        "rope_cos_sin",
        "rope_inv_freq",
        "tp_plan",
    ),
)
