"""Model definitions: plain nn.Modules with no parallel code, one folder per family, found through the registry.

Importing this package imports no torch: it registers the built-in families' config classes (each folder's
config.py: `model_config.type` -> its class, what the config loader and `meshformer config explain` need), and the
families themselves (models/registry.py `BUILTIN_FAMILIES`: models/llama/, models/llama_moe/, models/deepseek/,
models/mistral/, models/gpt_oss/, models/glm4/, models/gemma3/) register on the registry's first use. What callers
import from here (`build_model`, `Transformer`, ...) loads when first asked (models/lazy.py)."""

from meshformer.models.lazy import lazy_exports
from meshformer.models.registry import (
    ModelFamily,
    families,
    family_for_hf,
    family_of,
    register_builtin_configs,
    register_family,
)

register_builtin_configs()

__getattr__, __dir__, _lazy = lazy_exports(
    __name__,
    init=("build_model", "create_model", "init_weights", "materialize"),
    **{"llama.model": ("KVCache", "Transformer", "num_params")},
)

__all__ = [*_lazy, "ModelFamily", "families", "family_for_hf", "family_of", "register_family"]
