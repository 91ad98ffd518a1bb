"""The `fp8_config` section: the decoder's linears trained in FP8 by torchao's float8 training (torchtitan's Float8
converter and its options), and the rules that tie it to the rest of the config (`check_fp8`, called by
config/validate.py). The conversion itself is parallel/float8.py; what needs the device (a GPU's FP8 units, the
process group's backend) is checked there, when the device is known.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshformer.config.fields import setting
from meshformer.errors import UserError

# torchao 0.18's Float8LinearConfig.from_recipe_name names.
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
SECTION = "fp8_config"


@dataclass
class Fp8Config:
    enable: bool = setting(
        False, "Train the decoder's linears in FP8 (torchao float8; not the output head or MoE routers)."
    )
    recipe: str = setting(
        "tensorwise",
        "Scaling: tensorwise (one scale per tensor, fastest), rowwise (one per row), rowwise_with_gw_hp (rowwise, "
        "weight gradients in bf16).",
        choices=RECIPES,
    )
    enable_fsdp_float8_all_gather: bool = setting(
        False, "FSDP2 gathers the weights already cast to FP8 (half bf16's bytes; tensorwise, GPU only)."
    )
    precompute_float8_dynamic_scale_for_fsdp: bool = setting(
        False, "With the FP8 all-gather: the weights' scales in one all-reduce after each optimizer step."
    )
    filter_fqns: list = setting(
        [], "Linears kept in bf16: a module whose name contains one of these strings (e.g. [mlp.down_proj])."
    )


def check_fp8(cfg) -> None:
    """The cross-field rules of fp8_config (a no-op when it is off)."""
    fc: Fp8Config = cfg.fp8_config
    if not fc.enable:
        return
    mc = cfg.model.model_config
    if mc.compute_dtype != "bfloat16":
        raise UserError(
            f"{SECTION}.enable=true with model.model_config.compute_dtype={mc.compute_dtype}: FP8 linears run "
            f"inside bf16 mixed precision: set compute_dtype: bfloat16, or fp8_config.enable: false"
        )
    if fc.enable_fsdp_float8_all_gather and fc.recipe != "tensorwise":
        raise UserError(
            f"{SECTION}.enable_fsdp_float8_all_gather=true with recipe={fc.recipe}: torchao gathers FP8 weights "
            f"with one scale per tensor only: use recipe: tensorwise, or enable_fsdp_float8_all_gather: false"
        )
    if fc.precompute_float8_dynamic_scale_for_fsdp and not fc.enable_fsdp_float8_all_gather:
        raise UserError(
            f"{SECTION}.precompute_float8_dynamic_scale_for_fsdp=true precomputes the scales of the FP8 all-gather: "
            f"set enable_fsdp_float8_all_gather: true too, or precompute_float8_dynamic_scale_for_fsdp: false"
        )
    if not all(isinstance(f, str) and f for f in fc.filter_fqns):
        raise UserError(f"{SECTION}.filter_fqns={fc.filter_fqns!r}: give a list of module-name pieces, e.g. [lm_head]")
