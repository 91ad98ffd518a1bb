"""What a model's weights need, from its config alone, before any module is built.

A `num_layers: 1000000` or `expert_num: 100000` typo must be refused in a second, naming the sizes and the bytes,
on every path that builds a model (train, plan, import, generate, eval): building a million meta-device layers
takes minutes and gigabytes before anything is said. Parameter counts of families with two kinds of decoder layer
(dense and Mixture-of-Experts) are counted on one layer of each kind, so they cost the same for 4 layers as for 4
million.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from meshformer.dtypes import DTYPE
from meshformer.errors import UserError

GIB = 1 << 30
# The fields that make a model big, in the order a message names them (MoE ones only for an MoE model).
SIZE_FIELDS = ("num_layers", "hidden_size", "vocab_size", "intermediate_size", "num_heads", "n_kv_heads", "head_dim")
MOE_SIZE_FIELDS = ("expert_num", "moe_intermediate_size", "shared_expert_num", "shared_expert_intermediate_size")


def layered_param_count(transformer_cls, mc) -> int:
    """Parameters of `transformer_cls(mc)` counted on a two-layer meta model (one dense layer, one sparse), each
    layer kind multiplied by how many of the model's layers are of it."""

    def num_params(module) -> int:  # model.parameters() counts a tied head once, as the families' param_count
        return sum(p.numel() for p in module.parameters())

    dense_layers = mc.num_layers - mc.moe_layer_count
    if mc.is_moe:
        moe = dataclasses.replace(mc.moe_config, first_k_dense_replace=1, decoder_sparse_step=1, mlp_only_layers=[])
        probe = dataclasses.replace(mc, num_layers=2, moe_config=moe)  # layer 0 dense, layer 1 sparse
    else:
        probe = dataclasses.replace(mc, num_layers=1)
    with torch.device("meta"):
        model = transformer_cls(probe)
    per_layer = [num_params(layer) for layer in model.layers.values()]
    rest = num_params(model) - sum(per_layer)
    sparse = per_layer[1] * mc.moe_layer_count if mc.is_moe else 0
    return rest + per_layer[0] * dense_layers + sparse


def size_fields(mc, names: dict[str, str] | None = None) -> str:
    """`num_layers=32, hidden_size=4096, ...`: the size fields that are set, under `names` (the source's own
    spelling, e.g. config.json's num_hidden_layers) where given."""
    names = names or {}
    values = [(f, getattr(mc, f)) for f in SIZE_FIELDS]
    if mc.is_moe:
        values += [(f, getattr(mc.moe_config, f)) for f in MOE_SIZE_FIELDS]
    return ", ".join(f"{names.get(f, f)}={v}" for f, v in values if v)  # unset (None) and 0 say nothing


def weights_bytes(mc) -> int:
    """Bytes of the model's weights in param_init_type (what an import, generation or evaluation holds at least);
    a QLoRA model's at least half a byte each (its NF4 base)."""
    from meshformer.models.registry import family_of

    n = family_of(mc).param_count(mc)
    if mc.pet_config.quantize_base == "nf4":
        return n // 2
    return n * torch.empty((), dtype=DTYPE[mc.param_init_type]).element_size()


def device_memory_bytes(device: torch.device) -> int | None:
    """Total memory of the device (a GPU), or of the machine for the CPU; None when unknown."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_weights_fit(mc, device: torch.device | str, where: str, names: dict[str, str] | None = None) -> None:
    """Refuse, in one line naming the sizes and the bytes, a model whose weights alone exceed the device's memory."""
    device = torch.device(device)
    have = device_memory_bytes(device)
    need = weights_bytes(mc)
    if have is None or need <= have:
        return
    from meshformer.models.registry import family_of

    raise UserError(
        f"{where}: {family_of(mc).param_count(mc):,} parameters ({size_fields(mc, names)}) need "
        f"{need / GIB:,.1f} GiB for the weights alone ({mc.param_init_type}), but the {device.type} has "
        f"{have / GIB:,.1f} GiB: check those sizes for a typo"
    )
