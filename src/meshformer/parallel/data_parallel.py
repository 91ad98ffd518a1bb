"""Data parallelism and optimizer sharding on FSDP2's machinery.

- No sharding: `replicate` (DDP semantics on FSDP2's engine: parameters stay whole, gradients are
  all-reduced/averaged over the `dp_replicate` mesh after backward).
- Sharding (`parallel_config.optimizer_shard`, `parallel.enable_parallel_optimizer` or
  `optimizer.optimizer_parallel > 0`, or context parallel ranks): `fully_shard` over the named "fsdp" mesh
  (dp_shard x cp, parallel/dims.py); with `dp_replicate` > 1 the mesh is 2-D (`dp_replicate` x "fsdp") and
  FSDP2 runs HSDP (shard inside a group, all-reduce across groups). Parameters, gradients and AdamW states all
  live sharded, so memory per rank for them falls by the shard degree.

Each decoder layer is its own FSDP unit (one all-gather / reduce-scatter per layer, overlapped with compute)
and the root module takes the rest (embedding, final norm, output projection). Under expert parallelism (which
always shards: ep borrows dp_shard ranks) each layer's routed experts are a unit of their own on the expert mesh,
over "efsdp" (HSDP with "dp_replicate"), sharded along their feature dim (dim 0 is ep's), and the dense units
ignore them (`shard_experts`).
`recompute_config.parallel_optimizer_comm_recompute` picks when parameters are re-sharded: false keeps them
gathered from forward to backward (ZeRO-2-like, less communication), true frees them after forward and
all-gathers again in backward (ZeRO-3, less memory). `parallel_config.cpu_offload` keeps the shards, their
gradients and the optimizer states in host memory (FSDP2's CPUOffloadPolicy): the device holds only the layers
being computed, and the optimizer steps on the CPU.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from meshformer.backends.torch_private import replicate_with_fsdp
from meshformer.config.schema import MeshformerConfig
from meshformer.parallel.env import ParallelEnv


def mixed_precision(cfg: MeshformerConfig) -> MixedPrecisionPolicy:
    """bf16 compute over fp32 master weights: gather parameters in bf16, reduce gradients in fp32."""
    mc = cfg.model.model_config
    if mc.compute_dtype != "float32" and mc.param_init_type == "float32":
        low = torch.bfloat16 if mc.compute_dtype == "bfloat16" else torch.float16
        return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def reshard_after_forward(cfg: MeshformerConfig) -> bool:
    zero = cfg.parallel_config.zero_stage
    if zero is not None:
        return int(zero) >= 3
    return bool(cfg.recompute_config.parallel_optimizer_comm_recompute)


def apply_data_parallel(model: nn.Module, cfg: MeshformerConfig, env: ParallelEnv) -> None:
    """Wrap one model part in place for data parallelism over env's loss mesh (dp x cp; no-op when it is 1 rank)."""
    if env.mesh_size("loss") == 1:
        return
    mp = mixed_precision(cfg)
    layers = list(model.layers.values())
    if env.sharded:
        mesh = env.mesh_for("dp_replicate", "fsdp") if env.dp_replicate_size > 1 else env.mesh_for("fsdp")
        reshard = reshard_after_forward(cfg)
        kw = {"mp_policy": mp}
        if cfg.parallel_config.cpu_offload:  # shards, gradients and optimizer states in host memory
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=env.device.type == "cuda")
        ignored = shard_experts(model, env, reshard, kw)
        if ignored:
            kw["ignored_params"] = ignored
        for layer in layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, **kw)
        # The root's parameters (embedding, norm, head) are used last in forward and first in backward:
        # keeping them gathered avoids an immediate re-gather.
        fully_shard(model, mesh=mesh, reshard_after_forward=False, **kw)
    else:
        replicate = replicate_with_fsdp()
        mesh = env.mesh_for("dp_replicate")
        kw = {"mp_policy": mp, "ignored_params": frozen_subclass_params(model)}
        for layer in layers:
            replicate(layer, mesh=mesh, **kw)
        replicate(model, mesh=mesh, **kw)


def frozen_subclass_params(model: nn.Module) -> set[nn.Parameter]:
    """Frozen parameters of a tensor subclass (a QLoRA NF4 base weight): replication has no gradient of theirs to
    reduce, and would run their FSDP all-gather hooks on a whole tensor, which they take only as shards."""
    return {p for p in model.parameters() if not p.requires_grad and type(p) is not nn.Parameter}


def shard_experts(model: nn.Module, env: ParallelEnv, reshard: bool, kw: dict) -> set:
    """Under expert parallelism: FSDP of each routed expert layer over what ep leaves of the data-parallel ranks
    ("efsdp", with "dp_replicate" as HSDP), on the experts' own mesh. Returns the expert weights the dense units
    must ignore: all of them (each expert layer is its own unit, or, with nothing left to shard over, stays as
    expert parallelism made it). Their gradient scaling is parallel/expert_parallel.py's."""
    if env.dims.ep == 1:
        return set()
    from torch.distributed.tensor import Shard

    from meshformer.parallel.expert_parallel import expert_params, routed_experts

    replicas = env.dp_replicate_size
    if env.mesh_size("efsdp") * replicas > 1:
        mesh = env.mesh_for("dp_replicate", "efsdp") if replicas > 1 else env.mesh_for("efsdp")
        for experts in routed_experts(model):
            # dim 0 is ep's; FSDP splits the features (uneven sizes are padded)
            fully_shard(experts, mesh=mesh, reshard_after_forward=reshard, shard_placement_fn=lambda p: Shard(1), **kw)
    return expert_params(model)


def reshard(parts: list[nn.Module]) -> None:
    """Free every FSDP-gathered parameter of `parts`. A model that only runs forward needs it: FSDP reshards the
    root (and, below ZeRO-3, the layers) in backward, so without one the whole model stays gathered on every rank."""
    for part in parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


def set_grad_sync(parts: list[nn.Module], sync: bool) -> None:
    """Skip the gradient reduce on non-final micro-batches (gradients accumulate locally, reduced once)."""
    for p in parts:
        if isinstance(p, FSDPModule):
            p.set_requires_gradient_sync(sync)
