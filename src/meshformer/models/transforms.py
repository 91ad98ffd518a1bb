"""Model transforms: changes to the plain model after `build_model` and before `parallelize`, in one order.

A transform rewrites the meta-device model in place: it wraps layers (LoRA) or freezes parameters. Running them
before parallelism is what lets every transform compose with every layout: pipeline splitting, the
tensor-parallel plan (a wrapper declares `tp_subplan`, see parallel/tp.py), recompute and FSDP all see the
transformed model and need no transform-specific code.

Each transform lives in its own module beside the models and is registered in TRANSFORMS, whose order is the
order they run in:
  1. LoRA               wraps the target linears (must see the original modules)
  2. NF4 base (QLoRA)   stores LoRA's base linears in 4-bit (models/qlora.py)
  3. freezing           last, so its name patterns see the final parameter names
A transform that replaces modules (fused projections, say) joins between them.
A transform is enabled by its config fields (`wanted`); a run's applied transforms are logged by name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import nn

from meshformer.config.schema import MeshformerConfig


@dataclass(frozen=True)
class ModelTransform:
    name: str
    wanted: Callable[[MeshformerConfig], bool]  # is it enabled by this config?
    apply: Callable[[nn.Module, MeshformerConfig], None]  # rewrite the (meta-device) model in place


def _transforms() -> tuple[ModelTransform, ...]:
    from meshformer.models.lora import apply_lora, lora_wanted
    from meshformer.models.qlora import apply_nf4_base, nf4_wanted

    return (
        ModelTransform("lora", lora_wanted, apply_lora),
        ModelTransform("nf4 base", nf4_wanted, apply_nf4_base),
        ModelTransform("freeze", lambda cfg: bool(cfg.model.model_config.pet_config.freeze_include), apply_freeze),
    )


def apply_freeze(model: nn.Module, cfg: MeshformerConfig) -> None:
    """requires_grad False for parameters matching freeze_include but not freeze_exclude (fnmatch globs)."""
    import fnmatch

    from meshformer.errors import UserError

    pc = cfg.model.model_config.pet_config
    frozen = 0
    for name, p in model.named_parameters():
        if any(fnmatch.fnmatchcase(name, g) for g in pc.freeze_include) and not any(
            fnmatch.fnmatchcase(name, g) for g in pc.freeze_exclude
        ):
            p.requires_grad_(False)
            frozen += 1
    if not frozen:
        raise UserError(
            f"model.model_config.pet_config.freeze_include={pc.freeze_include}: matches no parameter (names look "
            f"like layers.0.self_attn.q_proj.weight, embed_tokens.weight)"
        )
    if not any(p.requires_grad for p in model.parameters()):
        raise UserError("model.model_config.pet_config: freeze_include freezes every parameter: nothing would train")


# The registry, in application order.
TRANSFORMS: tuple[ModelTransform, ...] = _transforms()


def apply_model_transforms(
    model: nn.Module, cfg: MeshformerConfig, transforms: Iterable[ModelTransform] | None = None
) -> list[str]:
    """Apply every wanted transform of `transforms` (default: TRANSFORMS) in order; returns their names."""
    applied = []
    for t in TRANSFORMS if transforms is None else transforms:
        if t.wanted(cfg):
            t.apply(model, cfg)
            applied.append(t.name)
    return applied
