"""GPT-OSS's Hugging Face `config.json` and tensors <-> ours (transformers 5's GptOssForCausalLM).

config.json: Llama's keys (models/llama/hf.py `common_fields` / `common_hf`, rotary read here) plus `sliding_window`,
`layer_types`, `num_local_experts`, `num_experts_per_tok`, `swiglu_alpha` / `swiglu_limit` and YaRN in
`rope_parameters` (rope_type yarn, factor, beta_fast, beta_slow, original_max_position_embeddings, truncate).
`router_aux_loss_coef` counts only with `output_router_logits` (a micro_batch loss, as the MoE Llama family reads
it). MXFP4-quantized checkpoints (the published gpt-oss weights: `quantization_config.quant_method: mxfp4`) are
refused in one line: dequantize them to bf16 first (transformers' `Mxfp4Config(dequantize=True)`).

Tensors on disk (what `save_pretrained` writes; the experts are stacked there too): `mlp.router.weight/bias` (ours
`mlp.gate.*`), `mlp.experts.gate_up_proj` [E, hidden, 2F] whose columns interleave gate (even) and up (odd),
`gate_up_proj_bias` [E, 2F] likewise, `down_proj` [E, F, hidden] (transposed: x @ W) and `down_proj_bias` [E, hidden];
ours are [E, F, hidden] gate_proj / up_proj, [E, hidden, F] down_proj and separate biases. Both ways are slicing and
transposition only, so an export is bit for bit.

GGUF: refused (interop/gguf_write.py names the architecture, as for Mistral), although the gguf package names
gpt-oss's tensors (attn_sinks, ffn_*_exps and their .bias) and llama.cpp's converter takes bf16 experts: GGUF has no
key for YaRN's `truncate: false` and llama.cpp's rope always rounds the correction range outwards
(ggml_rope_yarn_corr_dims: floorf / ceilf), so a file written from these weights would run in llama.cpp with other
rotary frequencies than transformers' GPT-OSS; and meshformer's GGUF writer has no routed-expert support yet (no MoE
family writes GGUF: the expert count keys and the split of the fused gate_up tensor would be building blocks of
their own).
"""

from __future__ import annotations

import dataclasses

import torch

from meshformer.config.schema import ModelConfig
from meshformer.errors import UserError
from meshformer.models.llama.hf import common_fields, common_hf
from meshformer.models.registry import hf_prefixed, hf_unprefixed

HF_MODEL_TYPES = {"gpt_oss": "GptOssForCausalLM"}
YARN_KEYS = ("factor", "beta_fast", "beta_slow", "original_max_position_embeddings")


def _int(hf: dict, key: str, where: str) -> int:
    value = hf.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"{where}: {key} missing or not an integer")
    return value


def _rope(hf: dict, where: str) -> tuple[float, dict]:
    """(theta, our rope_scaling section) from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling`."""
    spec = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    theta = float(hf.get("rope_theta", spec.get("rope_theta", 150000.0)))
    kind = spec.get("rope_type", spec.get("type", "default"))
    if kind in ("default", None):
        return theta, {"type": "none"}
    if kind != "yarn":
        raise UserError(f"{where}: rope scaling {kind!r} is not supported for GPT-OSS (default and yarn are)")
    if spec.get("attention_factor") is not None or spec.get("mscale") or spec.get("mscale_all_dim"):
        raise UserError(f"{where}: yarn with attention_factor, mscale or mscale_all_dim is not GPT-OSS's: unsupported")
    if not isinstance(spec.get("original_max_position_embeddings"), int) or not spec.get("factor"):
        raise UserError(f"{where}: yarn rope scaling needs factor and original_max_position_embeddings")
    scaling = {"type": "yarn", "factor": float(spec["factor"]), "yarn_truncate": bool(spec.get("truncate", True))}
    scaling |= {"original_max_position_embeddings": spec["original_max_position_embeddings"]}
    scaling |= {k: float(spec.get(k) or d) for k, d in (("beta_fast", 32.0), ("beta_slow", 1.0))}
    return theta, scaling


def _window(hf: dict, where: str) -> int | None:
    window = hf.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise UserError(f"{where}: sliding_window={window!r} must be a positive number of keys, or null (global)")
    return window


def config_from_hf(hf: dict, where: str = "config.json") -> dict:
    """The `model.model_config` fields (moe_config included) of a GptOssForCausalLM config.json."""
    quant = hf.get("quantization_config") or {}
    if quant:
        raise UserError(
            f"{where}: quantization_config (quant_method={quant.get('quant_method')!r}) is a quantized checkpoint: "
            f"meshformer imports bf16/fp32 weights (dequantize first: transformers' Mxfp4Config(dequantize=True))"
        )
    if hf.get("attention_bias") is False:
        raise UserError(f"{where}: attention_bias=false is not GPT-OSS's (its attention has biases)")
    experts, top_k = _int(hf, "num_local_experts", where), _int(hf, "num_experts_per_tok", where)
    if experts < 2 or not 2 <= top_k <= experts:
        raise UserError(
            f"{where}: num_local_experts={experts}, num_experts_per_tok={top_k}: meshformer needs at least 2 experts "
            f"and 2 <= top-k <= experts (top-1's weight would be 1.0 and its router would not train)"
        )
    theta, scaling = _rope(hf, where)
    fields = {"type": "GptOssConfig", **common_fields({**hf, "rope_parameters": None, "rope_scaling": None}, where)}
    fields.update(theta=theta, rope_scaling=scaling, qkv_has_bias=True, sliding_window=_window(hf, where))
    fields["layer_types"] = list(hf.get("layer_types") or [])
    moe = {"expert_num": experts, "num_experts_chosen": top_k, "norm_topk_prob": True}
    moe |= {"moe_intermediate_size": fields["intermediate_size"]}
    moe |= {"swiglu_alpha": float(hf.get("swiglu_alpha", 1.702)), "swiglu_limit": float(hf.get("swiglu_limit", 7.0))}
    coef = hf.get("router_aux_loss_coef", 0.001)
    if hf.get("output_router_logits") and coef:
        moe |= {"aux_loss_types": ["micro_batch"], "aux_loss_factors": [float(coef)]}
    fields["moe_config"] = moe
    return fields


def config_to_hf(mc: ModelConfig, dtype: str) -> dict:
    """A config.json transformers reads back as the same GptOssForCausalLM."""
    m, rs = mc.moe_config, mc.rope_scaling
    problems = [
        (not mc.qkv_has_bias, "qkv_has_bias=false (its attention has biases)"),
        (not (m.router_bias and m.expert_bias), "moe_config.router_bias / expert_bias false (it has both)"),
        (m.expert_activation != "clamped_swiglu", f"moe_config.expert_activation={m.expert_activation}"),
        (m.use_gating_sigmoid or m.topk_method != "greedy", "sigmoid or group-limited routing (it routes by softmax)"),
        (not m.norm_topk_prob, "moe_config.norm_topk_prob=false (its softmax is over the chosen experts)"),
        (m.routed_scaling_factor != 1.0 or m.balance_via_topk_bias, "a routing scale or bias update"),
        (mc.expert_ffn_size != mc.ffn_hidden_size, "moe_intermediate_size other than intermediate_size"),
    ]
    for bad, what in problems:
        if bad:
            raise UserError(f"model_config: type {mc.type} with {what} has no GptOssForCausalLM spelling")
    hf = common_hf(dataclasses.replace(mc, rope_scaling=type(rs)()), "gpt_oss", "GptOssForCausalLM", dtype)
    rope = {"rope_type": "default", "rope_theta": mc.theta}
    if rs.type == "yarn":
        rope = {**rope, "rope_type": "yarn", **{k: getattr(rs, k) for k in YARN_KEYS}, "truncate": rs.yarn_truncate}
    micro = [f for t, f in zip(m.aux_loss_types, m.aux_loss_factors) if t == "micro_batch"]
    hf.pop("rope_scaling")
    hf.pop("rope_theta")
    hf.update(rope_parameters=rope, attention_bias=True, sliding_window=mc.sliding_window)
    hf.update(layer_types=["sliding_attention" if mc.window_of(i) else "full_attention" for i in range(mc.num_layers)])
    hf.update(num_local_experts=m.expert_num, num_experts_per_tok=m.num_experts_chosen)
    hf.update(swiglu_alpha=m.swiglu_alpha, swiglu_limit=m.swiglu_limit, output_router_logits=bool(micro))
    hf["router_aux_loss_coef"] = float(micro[0]) if micro else 0.001
    return hf


def from_hf(name: str) -> str | None:
    ours = hf_unprefixed(name)
    return None if ours is None else ours.replace(".mlp.router.", ".mlp.gate.")


def to_hf(name: str) -> str:
    return hf_prefixed(name.replace(".mlp.gate.", ".mlp.router."))


def from_hf_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face's interleaved, transposed experts -> our stacked gate/up/down and biases."""
    out = {}
    for name, t in tensors.items():
        stem, _, leaf = name.rpartition(".")
        if not stem.endswith(".experts"):
            out[name] = t
        elif leaf == "gate_up_proj":
            out[f"{stem}.gate_proj"] = t[..., ::2].transpose(1, 2).contiguous()
            out[f"{stem}.up_proj"] = t[..., 1::2].transpose(1, 2).contiguous()
        elif leaf == "gate_up_proj_bias":
            out[f"{stem}.gate_bias"], out[f"{stem}.up_bias"] = t[:, ::2].contiguous(), t[:, 1::2].contiguous()
        elif leaf == "down_proj":
            out[f"{stem}.down_proj"] = t.transpose(1, 2).contiguous()
        elif leaf == "down_proj_bias":
            out[f"{stem}.down_bias"] = t
        else:
            out[name] = t
    return out


def to_hf_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Ours -> Hugging Face's (names still ours but for the experts' leaves: `to_hf` renames after)."""
    out = {}
    for name, t in state.items():
        stem, _, leaf = name.rpartition(".")
        if not stem.endswith(".experts") or leaf in ("up_proj", "up_bias"):
            if not stem.endswith(".experts"):
                out[name] = t
            continue
        if leaf == "gate_proj":
            up = state[f"{stem}.up_proj"]
            out[f"{stem}.gate_up_proj"] = torch.stack([t, up], dim=2).flatten(1, 2).transpose(1, 2).contiguous()
        elif leaf == "gate_bias":
            out[f"{stem}.gate_up_proj_bias"] = torch.stack([t, state[f"{stem}.up_bias"]], dim=2).flatten(1)
        elif leaf == "down_proj":
            out[f"{stem}.down_proj"] = t.transpose(1, 2).contiguous()
        elif leaf == "down_bias":
            out[f"{stem}.down_proj_bias"] = t
    return out
