"""Build a model on the meta device and initialise it deterministically.

Every parameter is drawn from its own generator, seeded by (seed, the parameter's name), in its full
(unsharded) shape; a rank that holds a shard (tensor parallel / FSDP DTensor) keeps its slice of that full
tensor. So the initial weights depend only on `seed` and the model config, never on the process layout:
a pipeline stage, a tensor-parallel shard and a single process all start from the same numbers. On a GPU the
numbers are drawn there (a CPU draws an 8B model's weights in minutes), from the GPU's generator: the same on every
GPU rank, different from a CPU run's.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from meshformer.config.schema import ModelConfig
from meshformer.dtypes import DTYPE
from meshformer.models.lora import lora_init
from meshformer.models.qlora import fill_nf4, is_nf4

# Wrapper prefixes that activation checkpointing and torch.compile add to parameter names.
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(fqn: str) -> str:
    for p in WRAPPER_PREFIXES:
        fqn = fqn.replace(p, "")
    return fqn


def build_model(mc: ModelConfig) -> nn.Module:
    """The model of mc's family (models/registry.py) on the meta device: no memory, no random numbers yet (see
    init_weights)."""
    from meshformer.models.registry import family_of

    family = family_of(mc)
    with torch.device("meta"):
        model = family.build(mc)
    for p in model.parameters():  # stored (master) weights in param_init_type; rotary buffers keep rotary_dtype
        p.data = p.data.to(DTYPE[mc.param_init_type])
    return model


def materialize(model: nn.Module, device: torch.device | str, seed: int, dtype: torch.dtype | None = None) -> nn.Module:
    """Allocate the (possibly parallelised) meta model on `device` and fill it deterministically."""
    model.to_empty(device=device)
    init_weights(model, seed, dtype)
    return model


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, dtype: torch.dtype | None = None) -> None:
    std = model.config.init_std if hasattr(model, "config") else 0.02
    for fqn, p in model.named_parameters():
        name = canonical_name(fqn)
        where = p.device if p.device.type == "cuda" else torch.device("cpu")
        full = _draw(name, tuple(p.shape), seed, std, where)  # a DTensor's shape is the global (full) shape
        fill = declared_fill(model, fqn)
        if fill is not None:
            full = torch.full_like(full, fill)
        if dtype is not None:
            full = full.to(dtype)
        if is_nf4(p):  # a QLoRA base weight: the codes of the full weight (models/qlora.py)
            fill_nf4(p, full)
        elif hasattr(p, "device_mesh"):  # DTensor: keep this rank's slice of the full tensor
            from torch.distributed.tensor import distribute_tensor

            local = distribute_tensor(full.to(p.device), p.device_mesh, p.placements, src_data_rank=None).to_local()
            p.to_local().copy_(local)
        else:
            p.copy_(full)
    for m in model.modules():
        if hasattr(m, "reset_buffers"):  # buffers that are state, not weights: rotary tables, an MoE routing bias
            m.reset_buffers()


def declared_fill(model: nn.Module, fqn: str) -> float | None:
    """The constant the module owning parameter `fqn` says its parameters start at (its `init_fill`), or None for
    the rule by name below: a norm that scales by (1 + weight) starts at 0, the identity, not at 1."""
    owner = model.get_submodule(fqn.rpartition(".")[0]) if "." in fqn else model
    return getattr(owner, "init_fill", None)


def _draw(name: str, shape: tuple, seed: int, std: float, device: torch.device) -> torch.Tensor:
    with device:
        return _draw_here(name, shape, seed, std, device)


def _draw_here(name: str, shape: tuple, seed: int, std: float, device: torch.device) -> torch.Tensor:
    leaf = name.rsplit(".", 1)[-1]
    parent = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
    if "norm" in parent:  # input_layernorm, post_attention_layernorm, norm, q_norm, k_norm
        return torch.ones(shape)
    if leaf == "bias":
        return torch.zeros(shape)
    g = torch.Generator(device).manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    lora = lora_init(name, shape, g)
    if lora is not None:
        return lora
    return torch.randn(shape, generator=g) * std


def create_model(mc: ModelConfig, seed: int, device: torch.device | str = "cpu") -> nn.Module:
    """Single-process convenience: build, allocate and initialise in param_init_type."""
    model = build_model(mc)
    return materialize(model, device, seed, DTYPE[mc.param_init_type])


__all__ = ["build_model", "materialize", "init_weights", "create_model", "canonical_name"]
