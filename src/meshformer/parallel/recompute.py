"""Activation recomputation: wrap decoder layers so (some of) their activations are recomputed in backward.

Full: `recompute_config.recompute` is `true` (every layer), `false`, or MindSpore's per-stage list of layer counts
(`[7, 7]`: the first 7 layers of each stage's part; with virtual pipeline stages, of each part on that rank). A
fully recomputed layer keeps only its input and runs its forward again in backward.

Selective (`select_recompute`, op-level, torch's selective activation checkpointing): the layer keeps the
outputs of its matmuls (routed experts' grouped matmuls too), of attention (SDPA) and of collectives (expert
parallelism's all-to-alls too), and recomputes the cheap element-wise work between them (RMSNorm internals,
rotary, SiLU, the SwiGLU product, residual adds): most of the memory of the norms and the MLP for a few percent of
the FLOPs. `true` selects every layer, a list counts layers per stage as for
`recompute`, and MindSpore's dict form (`{'feed_forward\\.mul': [14, 14], 'feed_forward\\.w1\\.activation\\.silu':
[14, 14]}`) selects the layers its counts name; its keys must name element-wise operations (mul, silu, add, norm,
...), all of which the policy recomputes (keeping everything but the named ones would keep more than no
recompute: the policy keeps every output it is told to keep). A layer counted by both is fully recomputed.

`select_recompute_policy` says which matmul outputs a selective layer keeps: `matmuls` every one; `alternate_matmuls`
is torchtitan's op-level SAC (what its benchmarks' selective runs ran): a count of the layer's linear matmuls,
fresh for each forward of the layer and counted again in its recompute, keeps the first, third, ... and
recomputes the second, fourth, ... (torchtitan's `mm_count % 2 == 0`). In a Llama layer that keeps q, v, gate and
down and recomputes k, o and up: less memory for part of the layer's forward matmuls run again. Attention and
collectives stay kept. models/activations.py `kept_matmul` is the rule; the planner counts with it too.

`parallelize` applies it after tensor parallelism and before FSDP: the wrapper then recomputes the layer's
TP collectives too under full recompute (MindSpore's mp_comm_recompute), and FSDP's per-layer unit contains the
wrapper, so backward re-gathers (ZeRO-3) before recomputing. Parameter names gain `_checkpoint_wrapped_module.`,
which models.init.canonical_name and torch.distributed.checkpoint strip.
"""

from __future__ import annotations

from collections import defaultdict
from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import meshformer.backends.cpu  # noqa: F401 - registers torch.ops.meshformer.onednn_mm, kept below
from meshformer.backends.torch_private import (
    attention_kernel_ops,
    checkpoint_wrapper,
    functional_collective_ops,
    grouped_mm_op,
    quiet_selective_checkpoint_notice,
    tree_leaves,
)
from meshformer.models.activations import kept_matmul
from meshformer.models.attention import causal_attention, recomputed_causal_attention

aten = torch.ops.aten
quiet_selective_checkpoint_notice()  # its selective regions run no in-place op (backends/torch_private.py)

# Kept by selective recompute: the expensive results (matmuls, attention) and collectives (recomputing one would
# communicate again).
SAVED_OPS = {
    aten.mm,
    aten.addmm,
    aten.bmm,
    grouped_mm_op(),  # routed experts (models/moe/experts.py): their loop form's matmuls are kept alike
    *attention_kernel_ops(),
    torch.ops.meshformer.onednn_mm,  # fp32 CPU linears on oneDNN (backends/cpu.py)
    *functional_collective_ops(),
}


# Called with every tensor selective recompute keeps (memory accounting listens: train/memory.py). The policy's
# kept outputs live in the checkpoint's own storage, not in autograd's saved tensors, so saved-tensor hooks miss
# them; the storage below reports each as it is kept, and it is released when the recompute consumes it.
KEPT_LISTENERS: list = []


def _report(value) -> None:
    if KEPT_LISTENERS:
        for kept in tree_leaves(value):
            t = getattr(kept, "val", None)
            if isinstance(t, torch.Tensor):
                for listener in KEPT_LISTENERS:
                    listener(t)


class _ReportingSlots(dict):  # torch >= 2.12 keeps each op's outputs by call index
    def __setitem__(self, idx, value) -> None:
        super().__setitem__(idx, value)
        _report(value)


class _ReportingList(list):  # torch <= 2.11 appends them
    def append(self, value) -> None:
        super().append(value)
        _report(value)


def _selective_contexts(make_policy):
    forward, recompute = create_selective_checkpoint_contexts(make_policy())
    storage = getattr(forward, "storage", None)
    if isinstance(storage, defaultdict) and storage is getattr(recompute, "storage", None):
        slots = {dict: _ReportingSlots, list: _ReportingList}.get(storage.default_factory)
        if slots is not None:
            forward.storage = recompute.storage = defaultdict(slots)
    return forward, recompute


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    packet = getattr(op, "overloadpacket", op)
    return CheckpointPolicy.MUST_SAVE if packet in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


# The matmuls of linears that `alternate_matmuls` counts (torchtitan counts aten.mm; a linear with a bias runs
# addmm, an fp32 CPU linear meshformer's oneDNN op)
LINEAR_MATMULS = {aten.mm, aten.addmm, torch.ops.meshformer.onednn_mm}


def _alternate_matmuls():
    """A fresh alternate_matmuls policy for one checkpointed forward (and its recompute, counted apart)."""
    counts = {False: 0, True: 0}

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        packet = getattr(op, "overloadpacket", op)
        if packet in LINEAR_MATMULS:
            index = counts[ctx.is_recompute]
            counts[ctx.is_recompute] += 1
            return (
                CheckpointPolicy.MUST_SAVE
                if kept_matmul("alternate_matmuls", index)
                else CheckpointPolicy.PREFER_RECOMPUTE
            )
        return _save_matmuls(ctx, op, *args, **kwargs)

    return policy


_POLICY_MAKERS = {"matmuls": lambda: _save_matmuls, "alternate_matmuls": _alternate_matmuls}


def _count(setting, stage_index: int, n_layers: int) -> int:
    """Layers of this part a recompute setting covers: true -> all, [n per stage] -> n, false -> 0."""
    if setting is True:
        return n_layers
    if isinstance(setting, list):
        return min(int(setting[stage_index]), n_layers)
    return 0


def selective_plan(select, stage_index: int, n_layers: int) -> tuple[int, object]:
    """(layers of this part recomputed selectively, the policy function) of a select_recompute setting."""
    if isinstance(select, dict):  # keys were checked by config validation (check_select_recompute)
        counts = 0
        for layers in select.values():
            counts = max(counts, _count(layers if isinstance(layers, list) else bool(layers), stage_index, n_layers))
        return counts, _save_matmuls
    return _count(select, stage_index, n_layers), _save_matmuls


def apply_recompute(
    model: nn.Module, recompute: bool | list, stage_index: int = 0, select=False, select_policy: str = "matmuls"
) -> tuple[int, int]:
    """Wrap the first layers of this part in (non-reentrant) checkpointing, full then selective (keeping what
    `select_policy` keeps); returns the counts (full, selective)."""
    layers = model.layers
    keys = list(layers.keys())
    n_full = _count(recompute, stage_index, len(keys))
    n_select = selective_plan(select, stage_index, len(keys))[0]
    policy = _POLICY_MAKERS[select_policy]
    for i, key in enumerate(keys):
        if i < n_full:
            _attend_as_recomputed(layers[key])
            layers[key] = checkpoint_wrapper(layers[key], preserve_rng_state=False)
        elif i < n_select:
            _attend_as_recomputed(layers[key])
            context = partial(_selective_contexts, policy)
            layers[key] = checkpoint_wrapper(layers[key], preserve_rng_state=False, context_fn=context)
    return n_full, max(0, n_select - n_full)


def _attend_as_recomputed(layer: nn.Module) -> None:
    """The layer's attention blocks that call the models' `causal_attention` call `recomputed_causal_attention`
    instead (models/attention.py): the layer's checkpoint decides what it keeps. Another installed `attend`
    (context parallelism's) is left alone."""
    for module in layer.modules():
        if getattr(module, "attend", None) is causal_attention:
            module.attend = recomputed_causal_attention
