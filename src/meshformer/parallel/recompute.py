"""Activation recomputation: wrap decoder layers so their activations are recomputed in backward.

`recompute_config.recompute` is `true` (every layer), `false`, or MindSpore's per-stage list of layer counts
(`[7, 7]`: the first 7 layers of each stage's part; with virtual pipeline stages, of each part on that rank).

`parallelize` applies it after tensor parallelism and before FSDP: the wrapper then recomputes the layer's
TP collectives too (MindSpore's mp_comm_recompute), and FSDP's per-layer unit contains the wrapper, so
backward re-gathers (ZeRO-3) before recomputing. Parameter names gain `_checkpoint_wrapped_module.`, which
models.init.canonical_name and torch.distributed.checkpoint strip.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper


def apply_recompute(model: nn.Module, recompute: bool | list, stage_index: int = 0) -> int:
    """Wrap the first N layers of this part in non-reentrant checkpointing; returns N."""
    layers = model.layers
    if recompute is True:
        n = len(layers)
    elif isinstance(recompute, list):
        n = min(recompute[stage_index], len(layers))
    else:
        n = 0
    for key in list(layers.keys())[:n]:
        layers[key] = checkpoint_wrapper(layers[key], preserve_rng_state=False)
    return n
