"""The Mistral family: Llama's decoder with a sliding window on every layer (model.py), its config (config.py),
config.json mapping (hf.py) and its entry in the model-family registry; FLOPs and the KV cache follow the config's
`window_of` (the registry's windowed defaults). Mistral with `sliding_window: null` is this family too, its
attention global.

Importing the package imports none of them (no torch): its attributes load on first use (models/lazy.py)."""

from meshformer.models.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__, family=("MISTRAL",), config=("MistralConfig",), model=("MistralDecoderLayer", "MistralTransformer")
)
