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

import torch

from meshformer.config.schema import MeshformerConfig
from meshformer.dtypes import DTYPE
from meshformer.errors import UserError
from meshformer.models.registry import family_of
from meshformer.models.sizes import device_memory_bytes, size_fields, weights_bytes
from meshformer.parallel.dims import ParallelDims


def state_bytes_floor(cfg: MeshformerConfig, dims: ParallelDims) -> int:
    """Bytes of parameters + gradients + AdamW moments on the most loaded rank, at the least (LoRA: the frozen
    weights alone, their adapters are small; QLoRA: half a byte a weight)."""
    mc = cfg.model.model_config
    split = dims.tp * dims.pp * dims.dp_shard
    if mc.pet_config.pet_type == "lora":
        return weights_bytes(mc) // split
    item = torch.empty((), dtype=DTYPE[cfg.model.model_config.param_init_type]).element_size()
    return family_of(mc).param_count(mc) * item * 4 // split


def activation_bytes_floor(cfg: MeshformerConfig, dims: ParallelDims) -> int:
    """Bytes of one micro-batch's decoder-layer inputs on the most loaded pipeline stage, at the least."""
    from meshformer.parallel.batch_plan import BatchPlan

    mc = cfg.model.model_config
    if cfg.swap_config.swap:
        return 0
    # The residual stream is in the compute dtype or the parameters' (autocast over fp32 weights): the narrower.
    item = min(torch.empty((), dtype=DTYPE[d]).element_size() for d in (mc.compute_dtype, mc.param_init_type))
    layers = -(-mc.num_layers // dims.pp)
    shard = dims.tp if cfg.parallel_config.use_seq_parallel else 1
    return BatchPlan.from_config(cfg, dims).micro_batch * mc.seq_length * mc.hidden_size * item * layers // shard


def check_fits(cfg: MeshformerConfig, dims: ParallelDims, device: torch.device) -> None:
    need, have = state_bytes_floor(cfg, dims), device_memory_bytes(device)
    if have is None:
        return
    mc = cfg.model.model_config
    gib = 1 << 30
    acts = activation_bytes_floor(cfg, dims)
    if need <= have and need + acts > have:
        from meshformer.parallel.batch_plan import BatchPlan

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
        f"model.model_config: {family_of(mc).param_count(mc):,} parameters ({size_fields(mc)}) need at least "
        f"{need / gib:,.1f} GiB per rank for weights, gradients and AdamW states, but the {device.type} has "
        f"{have / gib:,.1f} GiB: check those sizes for a typo, or split the model further (model_parallel, "
        "pipeline_stage, optimizer_shard)"
    )


def check_run_fits(cfg: MeshformerConfig, env) -> None:
    """`check_fits` on a started run's layout and device (a ParallelEnv), for `run_training`'s preflight."""
    check_fits(cfg, env.dims, env.device)


def check_plannable(cfg: MeshformerConfig, dims: ParallelDims, device_memory: float, accelerator: str) -> None:
    """Refuse a plan whose weights alone exceed the memory of all its devices together: no layout of them holds
    the model, and planning it runs every layer on fake tensors (minutes and gigabytes for a num_layers typo).
    Only the weights: a plan whose gradients and moments do not fit is still worth showing (the doctor's advice).
    Under cpu_offload the weights live in host memory, whose size the planner is not told: not checked."""
    if cfg.parallel_config.cpu_offload:
        return
    mc = cfg.model.model_config
    need, have = weights_bytes(mc), device_memory * dims.world_size
    if need <= have:
        return
    gib = 1 << 30
    raise UserError(
        f"model.model_config: {family_of(mc).param_count(mc):,} parameters ({size_fields(mc)}) need "
        f"{need / gib:,.1f} GiB for the weights alone ({mc.param_init_type}), more than the {dims.world_size} x "
        f"{accelerator} hold together ({have / gib:,.1f} GiB): check those sizes for a typo, or plan for more "
        f"devices (--devices)"
    )
