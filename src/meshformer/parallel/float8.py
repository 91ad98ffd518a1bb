"""FP8 linears (`fp8_config`): torchao's float8 training put on the model from outside it, as torchtitan's Float8
converter does.

`apply_float8` runs first in `parallelize`, on the whole meta-device model, so the pipeline split, tensor
parallelism (parallel/tp.py: torchao's Float8ColwiseParallel / Float8RowwiseParallel for a tensorwise recipe,
which cast the input and the gradient to FP8 with scales over the whole tensor), recompute, compile and FSDP2 all
see the converted modules. It converts the decoder's nn.Linear (under `layers.`): never the output head or the
embedding, not an MoE router (a parameter, not a linear), not a linear whose name contains one of
`fp8_config.filter_fqns`, and not one whose dims are not multiples of 16 (what FP8 matmul kernels take): those
stay in bf16 and the returned note lists them once. On a CPU the float8 products are emulated (float8_linear_config).
torchao's Float8Linear reads the CUDA autocast dtype only, so
on a CPU each converted linear casts its input to the CPU autocast dtype itself (`cpu_autocast_input`), as the
autocast of a plain linear would: the backward then meets bf16 on both sides, which the rowwise_with_gw_hp
recipe's high-precision weight gradient needs.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from meshformer.config.schema import MeshformerConfig
from meshformer.errors import UserError
from meshformer.parallel.env import ParallelEnv, backend_for

FP8_ALIGN = 16  # FP8 matmul kernels need both dims of a weight to be multiples of this
MIN_CAPABILITY = (8, 9)  # Ada and Hopper: the first NVIDIA GPUs with FP8 tensor cores


def torchao_float8():
    """torchao.float8, imported on first use (an optional dependency: the `lowp` extra), without the warnings
    logged at its import: the CUDA kernel libraries a CPU build or another GPU cannot load, and torch's notice about
    how torchao registers an enum."""
    import logging

    logs = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.ERROR)
    try:
        import torchao.float8
    except ImportError as e:
        raise UserError(
            f"fp8_config.enable=true needs torchao ({e}): pip install 'meshformer[lowp]', or set enable: false"
        ) from None
    finally:
        for log, level in zip(logs, levels, strict=True):
            log.setLevel(level)
    return torchao.float8


def float8_linear_config(cfg: MeshformerConfig, device: torch.device):
    """torchao's Float8LinearConfig for `fp8_config`: the named recipe, with the FSDP2 FP8 all-gather as asked. On a
    CPU torchao's emulation multiplies the float8 operands: the same casts and scales, the product of the rounded
    values in fp32 instead of `torch._scaled_mm`, whose CPU kernel is a reference loop hundreds of times slower than
    a bf16 matmul."""
    Float8LinearConfig = torchao_float8().Float8LinearConfig
    fc = cfg.fp8_config
    config = Float8LinearConfig.from_recipe_name(fc.recipe)
    return dataclasses.replace(
        config, enable_fsdp_float8_all_gather=fc.enable_fsdp_float8_all_gather, emulate=device.type == "cpu"
    )


def float8_choice(model: nn.Module, filter_fqns: list[str]) -> tuple[list[str], dict[str, str]]:
    """(the decoder linears to convert, {linear kept in bf16: why}), by module name."""
    convert, kept = [], {}
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear) or not name.startswith("layers."):
            continue
        hit = next((f for f in filter_fqns if f in name), None)
        if hit is not None:
            kept[name] = f"fp8_config.filter_fqns has {hit!r}"
        elif mod.in_features % FP8_ALIGN or mod.out_features % FP8_ALIGN:
            kept[name] = f"{mod.out_features}x{mod.in_features} is not a multiple of {FP8_ALIGN}"
        else:
            convert.append(name)
    return convert, kept


def check_float8_device(cfg: MeshformerConfig, env: ParallelEnv) -> None:
    """What fp8_config needs of this device and process group: FP8 units on a GPU, and an FP8 all-gather only where
    the collective backend can move float8 (NCCL; gloo has no float8 type)."""
    fc = cfg.fp8_config
    if env.device.type == "cuda":
        cap = torch.cuda.get_device_capability(env.device)
        if cap < MIN_CAPABILITY:
            name = torch.cuda.get_device_name(env.device)
            raise UserError(
                f"fp8_config.enable=true on {name} (compute capability {cap[0]}.{cap[1]}): FP8 matmuls need "
                f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (L4, L40S, H100, H200, B200): set "
                f"fp8_config.enable: false"
            )
    if fc.enable_fsdp_float8_all_gather and backend_for(env.device) == "gloo":
        raise UserError(
            "fp8_config.enable_fsdp_float8_all_gather=true on the gloo backend: gloo cannot all-gather float8 "
            "tensors: set enable_fsdp_float8_all_gather: false (CPU runs), or train on GPUs (NCCL)"
        )


def cpu_autocast_input(module: nn.Module, args: tuple) -> tuple | None:
    """Forward pre-hook: the input cast to the CPU autocast dtype while CPU autocast is on."""
    if args and args[0].device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        return (args[0].to(torch.get_autocast_dtype("cpu")), *args[1:])
    return None


def apply_float8(model: nn.Module, cfg: MeshformerConfig, env: ParallelEnv) -> str:
    """Convert the chosen linears of a (meta-device) model to torchao's Float8Linear in place; returns the note
    that names the recipe and the linears left in bf16 (empty when fp8_config is off)."""
    fc = cfg.fp8_config
    if not fc.enable:
        return ""
    check_float8_device(cfg, env)
    convert_to_float8_training = torchao_float8().convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    convert, kept = float8_choice(model, fc.filter_fqns)
    if not convert:
        raise UserError(
            f"fp8_config.enable=true converts no linear of this model (kept in bf16: {_listed(kept)}): "
            f"widen its layers to multiples of {FP8_ALIGN}, trim fp8_config.filter_fqns, or set enable: false"
        )
    chosen = set(convert)
    convert_to_float8_training(
        model, config=float8_linear_config(cfg, env.device), module_filter_fn=lambda mod, fqn: fqn in chosen
    )
    if env.device.type == "cpu":
        for mod in model.modules():
            if isinstance(mod, Float8Linear):
                mod.register_forward_pre_hook(cpu_autocast_input)
    note = f"fp8: {len(convert)} decoder linears in FP8 ({fc.recipe})"
    return note + (f"; kept in bf16: {_listed(kept)}" if kept else "")


def _listed(kept: dict[str, str], limit: int = 6) -> str:
    """The kept linears, shapes grouped: layer indices folded to `layers.*` so a 32-layer model lists once."""
    import re

    folded: dict[str, str] = {}
    for name, why in kept.items():
        folded.setdefault(re.sub(r"^layers\.\d+\.", "layers.*.", name), why)
    items = [f"{n} ({w})" for n, w in folded.items()]
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more or "none"


def float8_kind(module: nn.Module) -> str:
    """How tensor parallelism treats a module: "tensorwise" for a torchao Float8Linear whose recipe scales per
    tensor (torchao's FP8 styles), "tensorwise_bias" for one with a bias (float8_bias_styles), "" otherwise."""
    import sys

    if "torchao.float8" not in sys.modules:  # no FP8 linear can exist before torchao.float8 is imported
        return ""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_linear import Float8Linear

    if not isinstance(module, Float8Linear):
        return ""
    if module.config.cast_config_input.scaling_granularity is not ScalingGranularity.TENSORWISE:
        return ""
    return "tensorwise_bias" if module.bias is not None else "tensorwise"


def float8_bias_styles() -> tuple[type, type]:
    """torchao's FP8 column and row styles for a linear with a bias: the input still cast to FP8 before it is
    gathered, the output left as the plain styles leave it. torchao's own output step casts the output gradient to
    FP8 after the module's bias add, so the bias gradient would be summed from FP8-rounded values (off by percents
    against one process, whose Float8Linear adds the bias outside its FP8 matmul); here the Float8Linear's own
    backward casts the gradient of its matmul, over the whole (DTensor) tensor, and the bias sees it unrounded."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    from meshformer.backends.torch_private import tp_style_output_fn

    class Float8ColwiseParallelBias(Float8ColwiseParallel):
        _prepare_output_fn = staticmethod(tp_style_output_fn(ColwiseParallel))

    class Float8RowwiseParallelBias(Float8RowwiseParallel):
        _prepare_output_fn = staticmethod(tp_style_output_fn(RowwiseParallel))

    return Float8ColwiseParallelBias, Float8RowwiseParallelBias
