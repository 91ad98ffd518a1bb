"""The GLM-4 family (GLM-4-0414, Hugging Face `glm4`): Llama's decoder with partial interleaved rotary and post-block
norms (model.py), its config (config.py), config.json and fused gate/up mapping (hf.py), GGUF names (gguf.py), and its
entry in the model-family registry. FLOPs, the KV cache and context parallelism are grouped-query attention's, as
Llama's: the rotary layout is its tables' (model.py), applied before context parallelism's `attend`.

Importing the package imports none of them (no torch): its attributes load on first use (models/lazy.py)."""

from meshformer.models.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__, family=("GLM4",), config=("Glm4Config",), model=("Glm4DecoderLayer", "Glm4Transformer", "GlmRopeTables")
)
