"""Gemma 3's Hugging Face `config.json` (`gemma3_text`, Gemma3ForCausalLM) <-> `model.model_config`.

Rotary settings are read in both spellings: transformers 5's `rope_parameters` per layer type
({"full_attention": {rope_type, rope_theta, factor}, "sliding_attention": {...}}) and the hub's (transformers 4)
`rope_theta` + `rope_local_base_freq` + `rope_scaling` (linear, the global layers only). The layer pattern is
`layer_types` when given, else `sliding_window_pattern` (transformers' default 6). Written back in the hub spelling
with `layer_types`, which transformers 4 and 5 both read.

What meshformer's Gemma 3 does not compute is refused in one line naming the key: logit softcapping (Gemma 2's, off
in Gemma 3), bidirectional attention (EmbeddingGemma), biases, another activation or rotary scaling.
"""

from __future__ import annotations

from meshformer.config.schema import ModelConfig
from meshformer.errors import UserError
from meshformer.models.gemma3.config import FULL, SLIDING
from meshformer.models.llama.hf import common_fields, hf_sizes, hf_vocabulary, refuse_first

HF_MODEL_TYPES = {"gemma3_text": "Gemma3ForCausalLM"}
ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters", "rope_local_base_freq")


def _positive(hf: dict, key: str, where: str, default):
    value = hf.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise UserError(f"{where}: {key}={value!r} must be a positive number")
    return value


def _rope(hf: dict, where: str) -> dict:
    """theta, rope_local_base_freq and global_rope_scaling_factor from either spelling."""
    params = hf.get("rope_parameters") or {}
    full = dict(params.get(FULL) or {})
    local = dict(params.get(SLIDING) or {})
    scaling = hf.get("rope_scaling") or {}
    full = {**full, **scaling}  # transformers 5 folds rope_scaling into the global layers' parameters too
    for kind, spec in ((FULL, full), (SLIDING, local)):
        rope_type = spec.get("rope_type", spec.get("type", "default"))
        if rope_type not in ("default", "linear") or (kind == SLIDING and rope_type != "default"):
            raise UserError(
                f"{where}: {kind} rope_type {rope_type!r} is not supported (default, or linear on the global layers): "
                f"meshformer would compute other positions than the original model"
            )
    linear = full.get("rope_type", full.get("type")) == "linear"
    return {
        "theta": float(full.get("rope_theta", hf.get("rope_theta", 1_000_000.0))),
        "rope_local_base_freq": float(local.get("rope_theta", hf.get("rope_local_base_freq", 10_000.0))),
        "global_rope_scaling_factor": float(_positive(full, "factor", where, 1.0)) if linear else 1.0,
    }


def _refuse_unsupported(hf: dict, where: str) -> None:
    act = hf.get("hidden_activation", hf.get("hidden_act", "gelu_pytorch_tanh"))
    problems = {
        "hidden_activation": (act != "gelu_pytorch_tanh", f"{act!r} (Gemma 3's MLP is GeGLU with tanh GELU)"),
        "attention_bias": (bool(hf.get("attention_bias")), "true"),
        "final_logit_softcapping": (hf.get("final_logit_softcapping") is not None, "set (logit softcapping)"),
        "attn_logit_softcapping": (hf.get("attn_logit_softcapping") is not None, "set (attention softcapping)"),
        "use_bidirectional_attention": (bool(hf.get("use_bidirectional_attention")), "true"),
    }
    refuse_first(problems, where, "Gemma 3 model")


def _layer_types(hf: dict, where: str) -> list | None:
    types = hf.get("layer_types")
    if types is None:
        return None
    if not isinstance(types, list) or any(t not in (SLIDING, FULL) for t in types):
        raise UserError(f"{where}: layer_types={types!r} must list {SLIDING} or {FULL} for every layer")
    if len(types) != hf["num_hidden_layers"]:
        raise UserError(
            f"{where}: layer_types has {len(types)} entries, num_hidden_layers is {hf['num_hidden_layers']}"
        )
    return types


def config_from_hf(hf: dict, where: str = "config.json") -> dict:
    """The `model.model_config` fields of a Gemma3ForCausalLM (gemma3_text) config.json."""
    _refuse_unsupported(hf, where)
    fields = common_fields({k: v for k, v in hf.items() if k not in ROPE_KEYS}, where, tied_default=True)
    window = hf.get("sliding_window", 4096)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise UserError(f"{where}: sliding_window={window!r} must be a positive number of keys, or null (global)")
    pattern = hf.get("sliding_window_pattern", 6)
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern <= 0:
        raise UserError(f"{where}: sliding_window_pattern={pattern!r} must be a positive number of layers")
    return {
        "type": "Gemma3Config",
        **fields,
        **_rope(hf, where),
        "sliding_window": window,
        "sliding_window_pattern": pattern,
        "layer_types": _layer_types(hf, where),
        "query_pre_attn_scalar": float(_positive(hf, "query_pre_attn_scalar", where, 256)),
    }


def config_to_hf(mc: ModelConfig, dtype: str) -> dict:
    """A config.json transformers reads back as the same Gemma3ForCausalLM."""
    factor = mc.global_rope_scaling_factor
    scalar = mc.query_pre_attn_scalar
    return {
        **hf_sizes(mc, "gemma3_text", "Gemma3ForCausalLM"),
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": mc.rms_norm_eps,
        "rope_theta": mc.theta,
        "rope_local_base_freq": mc.rope_local_base_freq,
        "rope_scaling": None if factor == 1.0 else {"rope_type": "linear", "factor": factor},
        "sliding_window": mc.sliding_window,
        "sliding_window_pattern": mc.sliding_window_pattern,
        "layer_types": mc.layer_kinds(),
        "query_pre_attn_scalar": int(scalar) if float(scalar).is_integer() else scalar,
        "attention_bias": False,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        **hf_vocabulary(mc, dtype),
    }
