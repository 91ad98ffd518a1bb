"""What QLoRA's NF4 base (pet_config.quantize_base: nf4, models/qlora.py) adds to a plan's step time.

torchao's NF4 linear keeps no dequantized weight: its forward dequantizes the NF4 weight to the compute dtype before
the matmul, and its backward does it again for the input gradient (a recomputed layer's forward once more). A
dequantization is bound by device memory bandwidth: it reads the NF4 bytes (the 4-bit codes, the int8 block scales
and their factors: `nf4_bytes`) and writes the weight at the compute dtype's size. Per rank and step:
micro-batches x (2 + the recomputed share) x the rank's NF4 weights (its pipeline stage's layers, its tensor-parallel
share; FSDP gathers whole NF4 weights before it dequantizes them) at HBM bandwidth. Zero on a device without a
bandwidth figure.
"""

from __future__ import annotations

from meshformer.config.schema import MeshformerConfig
from meshformer.parallel.dims import ParallelDims
from meshformer.planner.accelerators import Accelerator
from meshformer.planner.extra_work import recompute_share


def nf4_shapes(cfg: MeshformerConfig) -> list[tuple[int, int]]:
    """(out, in) features of every weight QLoRA stores in NF4, on the meta-device model (cached by the model)."""
    import yaml

    from meshformer.config.load import to_dict

    key = yaml.safe_dump(to_dict(cfg.model), sort_keys=True)
    if key not in _SHAPES:
        from meshformer.models import build_model
        from meshformer.models.qlora import is_nf4
        from meshformer.models.transforms import apply_model_transforms

        model = build_model(cfg.model.model_config)
        apply_model_transforms(model, cfg)
        if len(_SHAPES) > 16:
            _SHAPES.clear()
        _SHAPES[key] = [tuple(p.shape) for p in model.parameters() if is_nf4(p)]
    return _SHAPES[key]


_SHAPES: dict = {}


def nf4_dequant_s(cfg: MeshformerConfig, dims: ParallelDims, acc: Accelerator, n_micro: int) -> float:
    """Seconds per rank and step that dequantizing the NF4 base weights takes (0 when QLoRA is off)."""
    from meshformer.models.qlora import nf4_bytes, nf4_wanted

    if not nf4_wanted(cfg) or not acc.hbm_bw:
        return 0.0
    a = 2 if cfg.model.model_config.compute_dtype != "float32" else 4
    per_pass = sum(nf4_bytes(n, k) + n * k * a for n, k in nf4_shapes(cfg)) / (dims.tp * dims.pp)
    return n_micro * (2 + recompute_share(cfg)) * per_pass / acc.hbm_bw
