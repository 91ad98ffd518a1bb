"""The Mixture-of-Experts block as plain modules, shared by the MoE families (models/llama_moe/, models/deepseek/).

router.py (`Router`: which experts each token goes to and with what weight), experts.py (`GroupedExperts`: the
routed SwiGLU experts, grouped matmuls or a per-expert loop), layer.py (`MoEBlock`: route, dispatch, combine, shared
experts), balance.py (the load-balancing losses, the routing bias update, the per-layer load statistics). No parallel
code: expert parallelism (parallel/expert_parallel.py) wraps `GroupedExperts` from outside.
"""

from meshformer.models.moe.experts import GroupedExperts
from meshformer.models.moe.layer import MoEBlock, SwiGLU
from meshformer.models.moe.router import Router, RouterOutput

__all__ = ["GroupedExperts", "MoEBlock", "Router", "RouterOutput", "SwiGLU"]
