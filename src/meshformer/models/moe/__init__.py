"""The Mixture-of-Experts block as plain modules, shared by the MoE families (models/llama_moe/, models/deepseek/).

router.py (`Router`: which experts each token goes to and with what weight), experts.py (`GroupedExperts`: the
routed SwiGLU experts, grouped matmuls or a per-expert loop), layer.py (`MoEBlock`: route, dispatch, combine, shared
experts), balance.py (the load-balancing losses, the routing bias update, the per-layer load statistics). No parallel
code: expert parallelism (parallel/expert_parallel.py) wraps `GroupedExperts` from outside.

Importing the package imports none of them (no torch): `config.py` (the `moe_config` section) is read by the config
loader and `meshformer config explain` without torch; the modules load on first use (models/lazy.py).
"""

from meshformer.models.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    experts=("GroupedExperts",),
    layer=("MoEBlock", "SwiGLU"),
    router=("Router", "RouterOutput"),
)
