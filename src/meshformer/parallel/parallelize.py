"""`parallelize`: the one place that composes the parallel techniques, in one order, on a meta-device model.

Order (see docs/design.md): pipeline split (which pieces this rank holds) -> tensor parallel (the model family's
plan, DTensor) -> activation recompute (wraps layers, so it also recomputes their TP collectives) -> activation
swap on the layers not recomputed (hooks, GPU runs only: a CPU run's host memory is its device memory) -> data
parallel or FSDP (wraps layers, then the piece, so FSDP's units contain the recompute wrappers). Model transforms
(LoRA, freezing, ...) ran before this, in models/transforms.py. Nothing is allocated until `materialize`.
"""

from __future__ import annotations

from torch import nn

from meshformer.config.schema import MeshformerConfig
from meshformer.parallel.data_parallel import apply_data_parallel
from meshformer.parallel.env import ParallelEnv
from meshformer.parallel.parts import LossFn, ModelParts
from meshformer.parallel.pipeline import split_pipeline
from meshformer.parallel.pipeline_parts import PipelineParts
from meshformer.parallel.recompute import apply_recompute
from meshformer.parallel.swap import apply_swap
from meshformer.parallel.tp import apply_tp


def wants_compile(cfg: MeshformerConfig, env: ParallelEnv) -> bool:
    """compile: true, false, or auto: on a GPU where it is proven (not with tensor parallelism, whose DTensor layers
    fail in backward when compiled on torch 2.13, nor with activation swap, whose hooks cannot run in a compiled
    layer); on a CPU compiling takes about a minute per process, more than most CPU runs gain (+11% on
    bench_vs_hf)."""
    if cfg.compile != "auto":
        return bool(cfg.compile)
    return env.device.type == "cuda" and env.tp_size == 1 and not cfg.swap_config.swap


def apply_compile(model: nn.Module) -> None:
    """torch.compile each decoder layer (after recompute wraps it, before FSDP wraps it, as torchtitan does): the
    layers share one compiled graph, and FSDP's hooks stay outside it."""
    import torch

    for key in list(model.layers.keys()):
        model.layers[key] = torch.compile(model.layers[key])


def parallelize(model: nn.Module, cfg: MeshformerConfig, env: ParallelEnv, loss_fn: LossFn) -> ModelParts:
    """Apply the configured parallelism to a meta-device model; returns the parts this rank holds (still meta)."""
    pieces = split_pipeline(model, cfg, env.pp_rank) if env.pp_size > 1 else [(0, model)]
    for _, part in pieces:
        if env.tp_size > 1:
            apply_tp(part, env.submesh("tp"), model.tp_plan(), cfg.parallel_config.use_seq_parallel)
        rc = cfg.recompute_config
        apply_recompute(part, rc.recompute, stage_index=env.pp_rank, select=rc.select_recompute)
        if env.device.type == "cuda":
            apply_swap(part, cfg.swap_config)
        if wants_compile(cfg, env):
            apply_compile(part)
        apply_data_parallel(part, cfg, env)
    if env.pp_size > 1:
        return PipelineParts([p for _, p in pieces], [s for s, _ in pieces], cfg, env, loss_fn)
    return ModelParts([model], cfg, env, loss_fn)
