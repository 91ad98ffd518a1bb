"""GLM-4's Hugging Face `config.json` and tensors <-> meshformer's.

config.json: Llama's keys (models/llama/hf.py `common_fields` / `common_hf`) plus `attention_bias` (q/k/v biases;
o_proj never has one in transformers' Glm4) and `partial_rotary_factor`, read from the top level (hub files) or from
`rope_parameters` (transformers 5), 0.5 when neither gives it (transformers' default). What GLM-4's model cannot be
(another activation, a rope scaling) is refused in one line naming the key.

Tensors: transformers' Glm4MLP keeps gate and up as one `gate_up_proj` [2 x intermediate, hidden] whose first half is
the gate; meshformer keeps them apart (model.py), so an import splits each fused matrix in two and an export joins
them: both exact, so an export is the original bit for bit.
"""

from __future__ import annotations

import re

import torch

from meshformer.config.schema import ModelConfig
from meshformer.errors import UserError
from meshformer.models.llama.hf import common_fields, common_hf

HF_MODEL_TYPES = {"glm4": "Glm4ForCausalLM"}
FUSED = "mlp.gate_up_proj.weight"
PARTS = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
_LAYER = re.compile(r"^(layers\.\d+\.)(.+)$")


def partial_rotary_factor(hf: dict, where: str) -> float:
    params = hf.get("rope_parameters") or {}
    factor = hf.get("partial_rotary_factor", params.get("partial_rotary_factor", 0.5))
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise UserError(f"{where}: partial_rotary_factor={factor!r} must be a fraction in (0, 1]")
    return float(factor)


def config_from_hf(hf: dict, where: str = "config.json") -> dict:
    """The `model.model_config` fields of a Glm4ForCausalLM config.json."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise UserError(f"{where}: hidden_act {act!r} is not supported by meshformer's GLM-4 model (SwiGLU with silu)")
    fields = common_fields(hf, where)
    if fields["rope_scaling"]["type"] != "none":
        raise UserError(f"{where}: a rope scaling is not supported by meshformer's GLM-4 model (default rope only)")
    return {
        "type": "Glm4Config",
        **fields,
        "qkv_has_bias": bool(hf.get("attention_bias", True)),
        "partial_rotary_factor": partial_rotary_factor(hf, where),
    }


def config_to_hf(mc: ModelConfig, dtype: str) -> dict:
    """A config.json transformers reads back as the same Glm4ForCausalLM."""
    if mc.use_qk_norm:
        raise UserError(f"model_config: type {mc.type} with use_qk_norm=True has no Glm4ForCausalLM spelling")
    hf = common_hf(mc, "glm4", "Glm4ForCausalLM", dtype)
    return {**hf, "attention_bias": mc.qkv_has_bias, "partial_rotary_factor": mc.partial_rotary_factor}


def from_hf_tensors(state: dict) -> dict:
    """Each layer's fused gate_up_proj -> our gate_proj (first half) and up_proj (second half)."""
    out = {}
    for name, tensor in state.items():
        m = _LAYER.match(name)
        if m and m.group(2) == FUSED:
            if tensor.shape[0] % 2:
                raise UserError(f"{name} has {tensor.shape[0]} rows: a fused gate/up projection has an even number")
            gate, up = tensor.chunk(2, dim=0)
            out[m.group(1) + PARTS[0]], out[m.group(1) + PARTS[1]] = gate.clone(), up.clone()
        else:
            out[name] = tensor
    return out


def to_hf_tensors(state: dict) -> dict:
    """Our gate_proj and up_proj of each layer -> Hugging Face's fused gate_up_proj (gate first). One without its
    partner (a LoRA adapter of gate_proj alone: models/lora.py asks for its name) has no Hugging Face spelling."""
    out = {}
    for name, tensor in state.items():
        m = _LAYER.match(name)
        if not (m and m.group(2) in PARTS):
            out[name] = tensor
            continue
        gate, up = (state.get(m.group(1) + part) for part in PARTS)
        if gate is None or up is None or gate.shape[1:] != up.shape[1:]:
            raise UserError(
                f"{name}: GLM-4's gate and up projections are one fused gate_up_proj in Hugging Face's Glm4, which a "
                f"PEFT adapter of one of them cannot name: adapt q_proj, k_proj, v_proj, o_proj or down_proj, or "
                f"export with --merge-lora (the full model)"
            )
        out[m.group(1) + FUSED] = torch.cat([gate, up], dim=0)
    return out
