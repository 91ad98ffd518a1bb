"""What FP8 linears (fp8_config) change in a plan's step time.

The linears `parallel/float8.py` converts (found on the meta-device model by the same `float8_choice`) do
6 x their weights' elements FLOPs per token, plus a recomputed layer's extra forward. The bf16 step time keeps
its calibrated `efficiency` for everything; FP8 takes those linears' matmul time at the bf16 peak out of it and puts
it back at the FP8 peak, both at `gemm_efficiency` (the share of peak a large matmul kernel reaches), then adds the
scaling and casting passes torchao's dynamic scaling makes, bound by device memory bandwidth (torchao's own
roofline: a float8 linear pays for its max-abs and casts, so small shapes gain nothing). Bytes per token and
converted linear (K inputs, N outputs): the input's max-abs read (2K) and cast (2K read, K written), the same for
the output gradient in backward (5N), and the transposed FP8 copies the weight gradient multiplies (K + N, each
read and written); per micro-batch and linear the weight's max-abs, cast and transposed copy (6KN, a tensor-parallel
rank's share of it). Tensor parallelism's activation casts are counted whole on every rank (an upper bound).
On a device without FP8 units (`peak_fp8` None) nothing changes: the plan is bf16's and says so.

Memory: with `enable_fsdp_float8_all_gather` (tensorwise, FSDP2) a converted linear's weight is cast to FP8 on its
shard and gathered in one byte per element instead of the compute dtype's, so the gathered layers' converted
weights take one byte each (`fp8_gathered_saving`); the planner's FSDP term (planner/plan.py) subtracts the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshformer.config.schema import MeshformerConfig
from meshformer.parallel.dims import ParallelDims
from meshformer.planner.accelerators import Accelerator
from meshformer.planner.extra_work import recompute_share


@dataclass(frozen=True)
class Fp8Figures:
    params: int  # weights of the linears that run in FP8, the whole model
    flops_share: float  # their share of the model FLOPs per token
    saved_s: float  # per rank and step: bf16 time of their matmuls - FP8 time - the casts (negative: FP8 is slower)
    cast_s: float  # the scaling and casting passes, per rank and step


def fp8_shapes(cfg: MeshformerConfig) -> list[tuple[int, int]]:
    """(in, out) features of every linear fp8_config converts, on the meta-device model (cached by the model)."""
    import yaml

    from meshformer.config.load import to_dict

    key = (yaml.safe_dump(to_dict(cfg.model), sort_keys=True), tuple(cfg.fp8_config.filter_fqns))
    if key not in _SHAPES:
        from meshformer.models import build_model
        from meshformer.models.transforms import apply_model_transforms
        from meshformer.parallel.float8 import float8_choice

        model = build_model(cfg.model.model_config)
        apply_model_transforms(model, cfg)
        chosen, _ = float8_choice(model, cfg.fp8_config.filter_fqns)
        if len(_SHAPES) > 16:
            _SHAPES.clear()
        _SHAPES[key] = [(model.get_submodule(n).in_features, model.get_submodule(n).out_features) for n in chosen]
    return _SHAPES[key]


_SHAPES: dict = {}


def fp8_figures(
    cfg: MeshformerConfig, dims: ParallelDims, acc: Accelerator, tokens: int, n_micro: int, flops_per_token: float
) -> Fp8Figures | None:
    """The FP8 change to one step of `tokens` (global) on this layout; None when fp8_config is off or the device
    has no FP8 units."""
    if not cfg.fp8_config.enable or acc.peak_fp8 is None:
        return None
    shapes = fp8_shapes(cfg)
    params = sum(k * n for k, n in shapes)
    share = 6 * params / max(flops_per_token, 1)
    world = dims.world_size
    fp8_flops = 6 * params * tokens / world * (1 + recompute_share(cfg) / 3)
    gemm_s = fp8_flops / (acc.peak_bf16 * acc.gemm_efficiency) - fp8_flops / (acc.peak_fp8 * acc.gemm_efficiency)
    rank_tokens = tokens / (dims.dp * dims.cp)  # every tp rank casts its micro-batches' activations
    activation_bytes = 7 * sum(k + n for k, n in shapes) / dims.pp * rank_tokens
    weight_bytes = 6 * params / (dims.pp * dims.tp) * n_micro
    cast_s = (activation_bytes + weight_bytes) / acc.hbm_bw if acc.hbm_bw else 0.0
    return Fp8Figures(params, share, gemm_s - cast_s, cast_s)


def fp8_gathered_saving(cfg: MeshformerConfig, compute_bytes: int) -> int:
    """Bytes FSDP2's FP8 all-gather saves on one decoder layer's gathered weights (whole, before tensor
    parallelism's share): the layer's converted linears at one byte per element instead of `compute_bytes`. Zero
    unless fp8_config gathers in FP8; a layer's share is the model's converted weights over its layers."""
    fc = cfg.fp8_config
    if not (fc.enable and fc.enable_fsdp_float8_all_gather) or compute_bytes <= 1:
        return 0
    converted = sum(k * n for k, n in fp8_shapes(cfg))
    return converted * (compute_bytes - 1) // max(1, cfg.model.model_config.num_layers)
