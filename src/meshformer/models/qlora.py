"""QLoRA: the frozen base linears of a LoRA model stored in 4-bit NF4 (`pet_config.quantize_base: nf4`).

A model transform that runs after LoRA: every `LoRALinear.base_layer` becomes `NF4Linear`, whose weight is a
torchao `NF4Tensor` parameter (the QLoRA paper's format: blocks of 64 weights share one absmax scale, 4-bit codes
on the NormalFloat grid, the scales themselves quantized to int8 in blocks with one fp32 factor each and the mean
subtracted). The forward dequantizes to the input's dtype (`linear_nf4`, which saves the 4-bit weight for backward,
not a dequantized copy). Embeddings, norms, the output head and the adapters stay in their dtype.

Why torchao's NF4Tensor and not bitsandbytes' Params4bit: NF4Tensor implements FSDP2's all-gather hooks
(`fsdp_pre_all_gather` / `fsdp_post_all_gather`), so a sharded layer gathers its 4-bit codes and int8 scales, not
a dequantized weight; bitsandbytes' 4-bit weights give wrong outputs under FSDP2 (bitsandbytes issue 1945).

When the numbers arrive: the transform swaps the modules on the meta device; the NF4 codes are computed from the
full fp32 weight when it is known (`fill_nf4`): at initialisation (models/init.py) and when base weights load
(checkpoint/store.py), on every rank from the same full tensor, and an FSDP rank then keeps its rows. So one
process and every layout hold the same codes. The scales' double quantization uses blocks of `SCALER_BLOCK`
scales, or the largest divisor of a layer's block count below it (a layer of 576 x 192 has 1,728 blocks: 216 per
scaler block); an FSDP shard must hold whole scaler blocks, which `check_nf4_layout` asks of the config.

Tensor parallelism is refused: NF4Tensor splits only along dim 0 into whole scaler blocks, while a row-parallel
linear (o_proj, down_proj) splits along dim 1, which cuts every 64-weight block row-wise apart.
"""

from __future__ import annotations

import torch
from torch import nn

from meshformer.backends.torch_private import dtensor_local
from meshformer.config.schema import MeshformerConfig
from meshformer.errors import UserError

NF4_BLOCK = 64  # weights per absmax scale (QLoRA's block size)
SCALER_BLOCK = 256  # scales per int8 double-quantization block (QLoRA's)


def nf4_wanted(cfg: MeshformerConfig) -> bool:
    return cfg.model.model_config.pet_config.quantize_base == "nf4"


def scaler_block(n_blocks: int) -> int:
    """Scales per double-quantization block of a layer with `n_blocks` absmax blocks: SCALER_BLOCK, or the
    largest divisor of n_blocks below it (torchao needs whole scaler blocks)."""
    return next(d for d in range(min(SCALER_BLOCK, n_blocks), 0, -1) if n_blocks % d == 0)


def nf4_bytes(out_features: int, in_features: int, dtype_bytes: int = 4) -> int:
    """Bytes of one NF4 weight as torchao stores it: 4-bit codes, an int8 scale per block, a factor per scaler
    block and the scales' mean in the weight's dtype, and the 16-entry code table."""
    numel = out_features * in_features
    n_blocks = numel // NF4_BLOCK
    n_scaler = n_blocks // scaler_block(n_blocks)
    return numel // 2 + n_blocks + n_scaler * dtype_bytes + dtype_bytes + 16 * dtype_bytes


SHARDED_PARTS = ("quantized_data", "quantized_scalers", "quantization_factor")  # what FSDP splits by rows


def nf4_local_bytes(p: torch.Tensor, shards: int) -> int:
    """Bytes one of `shards` FSDP ranks holds of NF4 weight `p` (a meta tensor will do): its rows of the codes,
    scales and factors, and the whole scale mean and code table."""
    local = nf4_local(p)
    parts = {name: getattr(local, name) for name in local.__tensor_flatten__()[0]}
    return sum(t.numel() * t.element_size() // (shards if name in SHARDED_PARTS else 1) for name, t in parts.items())


class NF4Linear(nn.Module):
    """A frozen linear whose weight is an NF4Tensor (no bias: the decoder linears LoRA adapts have none, and one
    that has a bias keeps it in its dtype)."""

    def __init__(self, base: nn.Linear):
        super().__init__()
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        self.in_features, self.out_features = base.in_features, base.out_features
        w = base.weight.detach()
        n_blocks = w.numel() // NF4_BLOCK
        self.weight = nn.Parameter(to_nf4(w, NF4_BLOCK, scaler_block(n_blocks)), requires_grad=False)
        self.bias = base.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

        y = linear_nf4(x, self.weight)
        return y if self.bias is None else y + self.bias

    def dequantized(self) -> torch.Tensor:
        """The weight the forward computes with, in the dtype it was quantized from."""
        return nf4_local(self.weight).get_original_weight()


def is_nf4(p: torch.Tensor) -> bool:
    return type(nf4_local(p)).__name__ == "NF4Tensor"


def nf4_local(p: torch.Tensor) -> torch.Tensor:
    """The tensor under a DTensor as it is stored (an FSDP shard's local NF4Tensor), else `p`."""
    return dtensor_local(p)


@torch.no_grad()
def fill_nf4(p: torch.Tensor, full: torch.Tensor) -> None:
    """Quantize the full (unsharded) weight `full` and store it in NF4 parameter `p`; a DTensor shard (FSDP,
    Shard(0)) keeps its rows of the codes of the whole weight."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    local = nf4_local(p)
    q = to_nf4(
        full.to(device=local.quantized_data.device, dtype=local.dtype), local.block_size, local.scaler_block_size
    )
    if hasattr(p, "device_mesh"):  # FSDP: Shard(0) over its mesh dim; DDP-style replication keeps it whole
        for dim, placement in enumerate(p.placements):
            if placement.is_shard(0):
                q = torch.chunk(q, p.device_mesh.size(dim), dim=0)[p.device_mesh.get_local_rank(dim)]
    for name in SHARDED_PARTS:
        getattr(local, name).copy_(getattr(q, name))
    # Not sharded, so FSDP's empty copy of them still sits on the meta device: take the quantized tensor's.
    local.scaler_mean, local.nf4 = q.scaler_mean, q.nf4


def check_nf4_widths(model: nn.Module) -> None:
    from meshformer.models.lora import LoRALinear

    for path, m in model.named_modules():
        if isinstance(m, LoRALinear) and m.base_layer.weight.numel() % NF4_BLOCK:
            raise UserError(
                f"model.model_config.pet_config.quantize_base=nf4: {path} ({m.base_layer.out_features} x "
                f"{m.base_layer.in_features}) does not split into NF4 blocks of {NF4_BLOCK} weights: leave it out of "
                f"target_modules, or use quantize_base: none"
            )


def check_nf4_layout(model: nn.Module, shards: int) -> None:
    """Each of `shards` FSDP ranks must hold whole rows and whole scaler blocks of every NF4 weight."""
    if shards == 1:
        return
    for path, m in model.named_modules():
        if isinstance(m, NF4Linear):
            n_blocks = m.weight.numel() // NF4_BLOCK
            if m.out_features % shards or (n_blocks // scaler_block(n_blocks)) % shards:
                raise UserError(
                    f"model.model_config.pet_config.quantize_base=nf4 with {shards} parameter shards: {path} "
                    f"({m.out_features} x {m.in_features}) does not split into {shards} whole NF4 scaler blocks; "
                    f"use fewer shards (parallel_config.data_parallel without optimizer_shard replicates it)"
                )


def apply_nf4_base(model: nn.Module, cfg: MeshformerConfig) -> None:
    """Every LoRA base linear becomes an NF4Linear (on the meta device: the codes come at fill time)."""
    from meshformer.config.validate import shard_degree
    from meshformer.models.lora import LoRALinear

    check_nf4_widths(model)
    for m in model.modules():
        if isinstance(m, LoRALinear):
            m.base_layer = NF4Linear(m.base_layer)
    check_nf4_layout(model, shard_degree(cfg) * cfg.parallel_config.context_parallel)


def dequantized_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with every NF4 weight dequantized (what `peft` over `transformers` compares with)."""
    state = dict(model.state_dict())
    for path, m in model.named_modules():
        if isinstance(m, NF4Linear):
            state[f"{path}.weight"] = m.dequantized()
    return state
