"""The DeepSeek family (DeepSeek-V2, V2-Lite, V3): multi-head latent attention (mla.py, its rotary and YaRN in
rope_yarn.py) with Mixture-of-Experts blocks (model.py), its config.json and per-expert tensor names (hf.py), and its
entry in the model-family registry. Multi-token prediction is left out (model.py says why).

Importing the package imports none of them (no torch): its attributes load on first use (models/lazy.py)."""

from meshformer.models.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    family=("DEEPSEEK",),
    config=("DeepseekConfig",),
    mla=("LatentAttention", "LatentCache"),
    model=("DeepseekTransformer", "param_count", "tp_plan"),
)
