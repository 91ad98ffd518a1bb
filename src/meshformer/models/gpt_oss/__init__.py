"""The GPT-OSS family: Llama's decoder with biased attention, learned sinks, sliding windows on alternate layers and
an MoE block with biased experts and the clamped SwiGLU on every layer (model.py), its config (config.py),
config.json and tensor mapping (hf.py) and its registry entry; FLOPs and the KV cache follow each layer's
`window_of`.

Importing the package imports none of them (no torch): its attributes load on first use (models/lazy.py)."""

from meshformer.models.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__, family=("GPT_OSS",), config=("GptOssConfig",), model=("GptOssDecoderLayer", "GptOssTransformer")
)
