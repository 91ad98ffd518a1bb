"""`parallelize`: the one place that composes the parallel techniques, in one order, on a meta-device model.

Order (see docs/design.md): FP8 linears (fp8_config: torchao's Float8Linear on the whole model, parallel/float8.py)
-> pipeline split (which pieces this rank holds) -> context parallel (attention over
keys gathered from the cp ranks, the root given its tokens' global layout) -> tensor parallel (the model family's
plan, DTensor; MoE routers and routed experts stay whole on every tp rank) -> expert parallel (routed experts
sharded by expert over "ep", their rows dispatched and combined by all-to-all) -> activation recompute (wraps
layers, so it also recomputes their TP collectives and all-to-alls) -> activation swap on the layers not
recomputed (hooks, GPU runs only: a CPU run's host memory is its device memory) -> compile (each layer, and the
loss, where `compile` says so) -> data parallel or FSDP (routed experts first, each layer's its own unit over
"efsdp" of the expert mesh; then the layers, then the piece, so FSDP's units contain the recompute wrappers).
Model transforms (LoRA, freezing, ...) ran before this, in models/transforms.py. Nothing is allocated until
`materialize`.
"""

from __future__ import annotations

import os

from torch import nn

from meshformer.config.schema import MeshformerConfig
from meshformer.models.registry import family_of
from meshformer.parallel.context_parallel import apply_context_parallel
from meshformer.parallel.data_parallel import apply_data_parallel
from meshformer.parallel.env import ParallelEnv
from meshformer.parallel.expert_parallel import apply_expert_parallel
from meshformer.parallel.float8 import apply_float8
from meshformer.parallel.parts import LossFn, ModelParts
from meshformer.parallel.pipeline import split_pipeline
from meshformer.parallel.pipeline_parts import PipelineParts
from meshformer.parallel.recompute import apply_recompute
from meshformer.parallel.swap import apply_swap
from meshformer.parallel.tp import apply_tp

# A CPU run compiles by default only when its work repays the compile: Inductor's cold compile costs a fixed time
# per process and then saves a share of each step, so only a run with enough work gains what it pays; 100 TFLOP per
# process is near the break-even on the CPUs of docs/benchmarks.md ("fp32 linears on oneDNN": compile costs and
# savings).
CPU_COMPILE_MIN_FLOPS = 1e14


def compile_decision(cfg: MeshformerConfig, env: ParallelEnv, run_flops: float | None = None) -> tuple[bool, str]:
    """(compile?, why) for `compile`: true and false are obeyed; auto compiles where it is proven and pays: not with
    tensor parallelism (its compiled layers are proven against one process on CPUs, not yet on a GPU), activation
    swap (its hooks cannot run in a compiled layer) or expert parallelism; on a GPU always, on a CPU when a C++
    compiler is found and the run's work per process (`run_flops`, the trainer's steps x tokens x FLOPs per token /
    processes) reaches CPU_COMPILE_MIN_FLOPS."""
    if cfg.compile != "auto":
        return bool(cfg.compile), f"compile: {str(bool(cfg.compile)).lower()}"
    if env.tp_size > 1:
        return False, "compile: auto -> off (tensor parallel layers compiled are proven on CPUs only: compile: true)"
    if env.dims.cp > 1:
        return False, "compile: auto -> off (context parallel attention is not proven compiled)"
    if env.dims.ep > 1:
        return False, "compile: auto -> off (expert parallelism's all-to-all sizes are read on the host: not proven)"
    if cfg.swap_config.swap:
        return False, "compile: auto -> off (activation swap's hooks cannot run in a compiled layer)"
    if env.device.type == "cuda":
        return True, "compile: auto -> on (GPU)"
    if env.device.type != "cpu":
        return False, f"compile: auto -> off (not proven on {env.device.type})"
    import shutil

    if not any(shutil.which(cxx) for cxx in (os.environ.get("CXX", "g++"), "g++", "c++", "clang++")):
        return False, "compile: auto -> off (no C++ compiler for Inductor's CPU kernels: install g++)"
    if run_flops is None:
        return False, "compile: auto -> off (run length unknown)"
    per_rank = run_flops / max(1, env.world_size)
    if per_rank < CPU_COMPILE_MIN_FLOPS:
        return False, (
            f"compile: auto -> off ({per_rank / 1e12:.3g} TFLOP per process is under the "
            f"{CPU_COMPILE_MIN_FLOPS / 1e12:.0f} TFLOP that repay compiling on a CPU; compile: true forces it)"
        )
    return True, f"compile: auto -> on ({per_rank / 1e12:.3g} TFLOP per process)"


def apply_compile(model: nn.Module) -> None:
    """torch.compile each decoder layer (after recompute wraps it, before FSDP wraps it, as torchtitan does): the
    layers share one compiled graph, and FSDP's hooks stay outside it."""
    import torch

    for key in list(model.layers.keys()):
        model.layers[key] = torch.compile(model.layers[key])


def compile_loss(loss_fn: LossFn) -> LossFn:
    """The loss compiled too: Inductor fuses log-softmax, the target gather and their backward over the
    [tokens, vocab] logits, which eager runs as separate passes (docs/benchmarks.md: the loss eager and
    compiled). Not under tensor parallelism: there the loss runs on vocab-sharded logits through
    `loss_parallel`'s DTensor op handlers, and compiled it gave a loss other than the single process's on torch
    2.13 (the tp2 parity case), so it stays eager; its work is a 1/tp share of the logits."""
    import torch

    return torch.compile(loss_fn)


def parallelize(
    model: nn.Module, cfg: MeshformerConfig, env: ParallelEnv, loss_fn: LossFn, run_flops: float | None = None
) -> ModelParts:
    """Apply the configured parallelism to a meta-device model; returns the parts this rank holds (still meta).
    `run_flops` (the whole run's model FLOPs) lets `compile: auto` judge whether compiling pays on a CPU; the parts'
    `compile_note` says what it decided and why."""
    compiled, why = compile_decision(cfg, env, run_flops)
    if compiled and env.tp_size == 1:  # see compile_loss: the vocab-parallel loss stays eager
        loss_fn = compile_loss(loss_fn)
    fp8_note = apply_float8(model, cfg, env)  # before the split: every stage's linears, listed once
    pieces = split_pipeline(model, cfg, env.pp_rank) if env.pp_size > 1 else [(0, model)]
    cp_note = None
    for _, part in pieces:
        cp_note = apply_context_parallel(part, env)  # each stage's root: its tokens' layout
        if env.tp_size > 1:
            plan = family_of(model.config).tp_plan(model)
            apply_tp(part, env.submesh("tp"), plan, cfg.parallel_config.use_seq_parallel)
        apply_expert_parallel(part, env)
        rc = cfg.recompute_config
        apply_recompute(
            part,
            rc.recompute,
            stage_index=env.pp_rank,
            select=rc.select_recompute,
            select_policy=rc.select_recompute_policy,
        )
        if env.device.type == "cuda":
            apply_swap(part, cfg.swap_config)
        if compiled:
            apply_compile(part)
        apply_data_parallel(part, cfg, env)
    if env.pp_size > 1:
        parts = PipelineParts([p for _, p in pieces], [s for s, _ in pieces], cfg, env, loss_fn)
    else:
        parts = ModelParts([model], cfg, env, loss_fn)
    parts.compile_note, parts.cp_note, parts.fp8_note = why, cp_note, fp8_note
    return parts
