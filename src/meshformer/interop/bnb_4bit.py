"""Hugging Face directories saved with a bitsandbytes 4-bit `quantization_config` (transformers'
`BitsAndBytesConfig(load_in_4bit=True)`, then `save_pretrained`), dequantized on import by the format's
definition, without bitsandbytes.

What transformers writes for each quantized linear `W` (nf4 or fp4, with or without double quantization):
`W.weight` (uint8, two 4-bit codes a byte, the first in the high nibble), `W.weight.quant_map` (the 16 code
values), `W.weight.absmax` (one scale per block of `blocksize` weights; with double quantization uint8 codes of
`W.weight.nested_quant_map`, one fp32 `W.weight.nested_absmax` per `nested_blocksize` of them, plus
`nested_offset`) and `W.weight.quant_state.bitsandbytes__<type>` (the JSON of blocksize, dtype, shape, offset,
as bytes). The last block of a weight may be partial. A weight is `quant_map[code] * absmax[its block]`.
"""

from __future__ import annotations

import json

import torch

from meshformer.errors import UserError

STATE = ".quant_state.bitsandbytes__"
PARTS = (".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map")


def is_bnb_4bit(config: dict) -> bool:
    quant = config.get("quantization_config") or {}
    return quant.get("quant_method") == "bitsandbytes" and bool(quant.get("load_in_4bit"))


def check_importable_quantization(config: dict, where: str) -> None:
    """A bitsandbytes 4-bit directory imports; another quantization is refused in one line."""
    quant = config.get("quantization_config") or {}
    if quant and quant.get("quant_method") == "bitsandbytes" and not quant.get("load_in_4bit"):
        raise UserError(
            f"{where}: quantization_config is bitsandbytes 8-bit: meshformer imports 4-bit (load_in_4bit) or "
            f"unquantized weights; save the model unquantized"
        )


def _blockwise(codes: torch.Tensor, table: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    values = table[codes.long()]
    return values * scales.repeat_interleave(block)[: values.numel()]


def dequantize_bnb_4bit(tensors: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """The directory's tensors with every 4-bit weight dequantized to its recorded dtype and shape."""
    out = {k: v for k, v in tensors.items() if STATE not in k and not k.endswith(PARTS)}
    for key in [k for k in tensors if STATE in k]:
        name = key[: key.index(STATE)]
        try:
            state = json.loads(bytes(tensors[key].tolist()).decode())
            absmax = tensors[f"{name}.absmax"]
            if "nested_blocksize" in state:
                absmax = _blockwise(
                    absmax, tensors[f"{name}.nested_quant_map"], tensors[f"{name}.nested_absmax"],
                    state["nested_blocksize"],
                ) + state["nested_offset"]  # fmt: skip
            packed = tensors[name].flatten()
            codes = torch.stack([packed >> 4, packed & 15], dim=1).flatten()
            shape = tuple(state["shape"])
            codes = codes[: torch.Size(shape).numel()]
            weight = _blockwise(codes, tensors[f"{name}.quant_map"], absmax.float(), state["blocksize"])
            out[name] = weight.reshape(shape).to(getattr(torch, state["dtype"]))
        except (KeyError, ValueError, TypeError, AttributeError, RuntimeError) as e:
            raise UserError(f"{where}: the bitsandbytes 4-bit weight {name} is incomplete or damaged ({e})") from None
    return out
