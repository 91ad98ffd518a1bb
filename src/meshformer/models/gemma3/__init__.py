"""The Gemma 3 family (text model, Hugging Face `gemma3_text`): its decoder of sliding and global layers built from
Llama's modules (model.py), its config (config.py), config.json mapping (hf.py), GGUF names (gguf.py) and its
entry in the model-family registry; FLOPs and the KV cache follow each layer's `window_of`.

Importing the package imports none of them (no torch): its attributes load on first use (models/lazy.py)."""

from meshformer.models.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__, family=("GEMMA3",), config=("Gemma3Config",), model=("Gemma3DecoderLayer", "Gemma3Transformer")
)
