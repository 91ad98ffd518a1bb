"""Does the model fit at all? A floor on each rank's memory, checked before anything is allocated.

A `num_layers: 3200` or `hidden_size: 409600` typo must fail in a second with the bytes it would need, not
after minutes of building modules and allocating until the machine swaps or the allocator aborts. The floor
counts only what certainly exists: the weights, their gradients and AdamW's two moments, divided by the
ways they are split (tensor parallel, pipeline stages, optimizer sharding). Activations, buffers and the
allocator's slack come on top (the planner estimates those), so a run that passes this may still not fit; one
that fails it cannot.
"""

from __future__ import annotations

import os

import torch

from meshformer.config.schema import MeshformerConfig
from meshformer.dtypes import DTYPE
from meshformer.errors import UserError
from meshformer.models.llama import param_count
from meshformer.parallel.dims import ParallelDims


def state_bytes_floor(cfg: MeshformerConfig, dims: ParallelDims) -> int:
    """Bytes of parameters + gradients + AdamW moments on the most loaded rank, at the least."""
    n = param_count(cfg.model.model_config)
    item = torch.empty((), dtype=DTYPE[cfg.model.model_config.param_init_type]).element_size()
    return n * item * 4 // (dims.tp * dims.pp * dims.dp_shard)


def device_memory_bytes(device: torch.device) -> int | None:
    """Total memory of the device (a GPU), or of the machine for the CPU; None when unknown."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(cfg: MeshformerConfig, dims: ParallelDims, device: torch.device) -> None:
    need, have = state_bytes_floor(cfg, dims), device_memory_bytes(device)
    if have is None or need <= have:
        return
    mc = cfg.model.model_config
    gib = 1 << 30
    raise UserError(
        f"model.model_config: {param_count(mc):,} parameters (hidden_size={mc.hidden_size}, num_layers="
        f"{mc.num_layers}, vocab_size={mc.vocab_size}) need at least {need / gib:,.1f} GiB per rank for weights, "
        f"gradients and AdamW states, but the {device.type} has {have / gib:,.1f} GiB: check those sizes for a typo, "
        f"or split the model further (model_parallel, pipeline_stage, optimizer_shard)"
    )
