"""Does the model fit at all? A floor on each rank's memory, checked before anything is allocated.

A `num_layers: 3200` or `hidden_size: 409600` typo must fail in a second with the bytes it would need, not
after minutes of building modules and allocating until the machine swaps or the allocator aborts. The floor
counts only what certainly exists: the weights, their gradients and AdamW's two moments, divided by the
ways they are split (tensor parallel, pipeline stages, optimizer sharding). Activations, buffers and the
allocator's slack come on top (the planner estimates those), so a run that passes this may still not fit; one
that fails it cannot. A `seq_length: 1000000000` or `batch_size: 1000000000` typo is caught the same way by the
activations that certainly exist: the input of every decoder layer of one micro-batch, which backward keeps
even under full recompute (not counted under activation swap, which moves them to host memory).
"""

from __future__ import annotations

import os

import torch

from meshformer.config.schema import MeshformerConfig
from meshformer.dtypes import DTYPE
from meshformer.errors import UserError
from meshformer.models.registry import family_of
from meshformer.parallel.dims import ParallelDims


def state_bytes_floor(cfg: MeshformerConfig, dims: ParallelDims) -> int:
    """Bytes of parameters + gradients + AdamW moments on the most loaded rank, at the least."""
    mc = cfg.model.model_config
    n = family_of(mc).param_count(mc)
    item = torch.empty((), dtype=DTYPE[cfg.model.model_config.param_init_type]).element_size()
    return n * item * 4 // (dims.tp * dims.pp * dims.dp_shard)


def activation_bytes_floor(cfg: MeshformerConfig, dims: ParallelDims) -> int:
    """Bytes of one micro-batch's decoder-layer inputs on the most loaded pipeline stage, at the least."""
    from meshformer.train.batch_plan import BatchPlan

    mc = cfg.model.model_config
    if cfg.swap_config.swap:
        return 0
    # The residual stream is in the compute dtype or the parameters' (autocast over fp32 weights): the narrower.
    item = min(torch.empty((), dtype=DTYPE[d]).element_size() for d in (mc.compute_dtype, mc.param_init_type))
    layers = -(-mc.num_layers // dims.pp)
    shard = dims.tp if cfg.parallel_config.use_seq_parallel else 1
    return BatchPlan.from_config(cfg, dims).micro_batch * mc.seq_length * mc.hidden_size * item * layers // shard


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
    if have is None:
        return
    mc = cfg.model.model_config
    gib = 1 << 30
    acts = activation_bytes_floor(cfg, dims)
    if need <= have and need + acts > have:
        from meshformer.train.batch_plan import BatchPlan

        mb = BatchPlan.from_config(cfg, dims).micro_batch
        raise UserError(
            f"model.model_config.seq_length={mc.seq_length} x micro batch {mb} x hidden_size={mc.hidden_size}: the "
            f"inputs of the decoder layers alone need at least {acts / gib:,.1f} GiB per rank (on top of "
            f"{need / gib:,.1f} GiB of weights and optimizer states), but the {device.type} has {have / gib:,.1f} "
            "GiB: check seq_length and train_dataset.batch_size for a typo"
        )
    if need <= have:
        return
    raise UserError(
        f"model.model_config: {family_of(mc).param_count(mc):,} parameters (hidden_size={mc.hidden_size}, num_layers="
        f"{mc.num_layers}, vocab_size={mc.vocab_size}) need at least {need / gib:,.1f} GiB per rank for weights, "
        f"gradients and AdamW states, but the {device.type} has {have / gib:,.1f} GiB: check those sizes for a typo, "
        f"or split the model further (model_parallel, pipeline_stage, optimizer_shard)"
    )
