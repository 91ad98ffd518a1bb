"""Parameter counts of an MoE model: all of them, the routed experts', and those one token passes through.

Counted on the family's own meta-device modules (nothing allocated), so any family built from `MoEBlock` /
`GroupedExperts` is counted the same way, DeepSeek's latent attention included. A token passes through the
attention, norms, dense MLPs, routers, shared experts and `num_experts_chosen` of each layer's `expert_num` routed
experts: active = total - routed x (1 - k / E). The model-FLOPs rule (models/registry.py `flops_per_token`, used by
the planner and the trainer's MFU) counts active parameters, as torchtitan's and Megatron's MoE MFU do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MoeParams:
    total: int  # every parameter of the model
    routed: int  # the routed experts' (GroupedExperts) parameters, all layers
    moe_layers: int  # decoder layers with routed experts

    def active(self, k: int, experts: int) -> int:
        """Parameters one token uses: everything but the routed experts it is not sent to."""
        return self.total - self.routed + self.routed * k // experts


def moe_params(family, mc) -> MoeParams:
    """The counts of `family`'s model for `mc` (cached: the planner's layout search asks many times)."""
    from meshformer.models.moe.experts import GroupedExperts

    key = (family.name, repr(mc))
    if key not in _CACHE:
        with torch.device("meta"):
            model = family.build(mc)
        total = sum(p.numel() for p in model.parameters())
        experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
        routed = sum(p.numel() for m in experts for p in m.parameters())
        if len(_CACHE) > 64:
            _CACHE.clear()
        _CACHE[key] = MoeParams(total, routed, len(experts))
    return _CACHE[key]


_CACHE: dict = {}


def active_param_count(family, mc) -> int:
    """Parameters one token passes through (top-k routed experts, everything else whole)."""
    m = mc.moe_config
    return moe_params(family, mc).active(m.num_experts_chosen, m.expert_num)
