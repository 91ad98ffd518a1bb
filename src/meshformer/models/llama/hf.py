"""The Llama family's Hugging Face `config.json` <-> `model.model_config`: Llama 2/3/3.1, SmolLM2, Qwen2/2.5, Qwen3
(Mistral, with or without its sliding window, is a family of its own: models/mistral/).

Both spellings of rotary settings are read: `rope_theta` + `rope_scaling` (hub files, transformers 4) and
`rope_parameters` (transformers 5). What meshformer's model cannot represent (biases on o_proj or the MLP,
sliding-window attention, other rope scalings, other activations) is refused in one line naming the key, never
silently dropped: a converted model that computes something else is worse than no conversion.
"""

from __future__ import annotations

from meshformer.config.schema import ModelConfig
from meshformer.errors import UserError
from meshformer.models.registry import hf_model_type

# Hugging Face model_type -> (our family type, architecture class name, that class's tie_word_embeddings default)
CONFIG_TYPES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", False),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", False),
}

# What the registry matches a config.json by: model_type -> architecture class name
HF_MODEL_TYPES = {model_type: arch for model_type, (_, arch, _) in CONFIG_TYPES.items()}


def refuse_first(problems: dict[str, tuple[bool, str]], where: str, model: str = "model", sep: str = " ") -> None:
    """One line naming the first of a config.json's `problems` ({key: (whether it is there, what it is)}) that
    meshformer's `model` does not build."""
    for key, (bad, what) in problems.items():
        if bad:
            raise UserError(f"{where}: {key}{sep}{what} is not supported by meshformer's {model}")


def _rope(hf: dict, where: str) -> tuple[float, dict]:
    """(theta, our rope_scaling section) from either spelling."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    spec = scaling or params
    kind = spec.get("rope_type", spec.get("type", "default")) if spec else "default"
    if kind in ("default", None):
        return float(theta), {"type": "none"}
    if kind != "llama3":
        raise UserError(
            f"{where}: rope scaling {kind!r} is not supported (default and llama3 are): meshformer would compute "
            f"other positions than the original model"
        )
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in spec]
    if missing:
        raise UserError(f"{where}: llama3 rope scaling lacks {', '.join(missing)}")
    return float(theta), {"type": "llama3", **{k: spec[k] for k in keys}}


def _refuse_unsupported(hf: dict, model_type: str, where: str) -> None:
    act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
    problems = {
        "hidden_act": (act != "silu", f"{act!r} (meshformer's MLP is SwiGLU with silu)"),
        "attention_bias": (
            bool(hf.get("attention_bias")) and model_type != "qwen2",
            "true (a bias on o_proj as well as q/k/v)",
        ),
        "mlp_bias": (bool(hf.get("mlp_bias")), "true"),
        "use_sliding_window": (bool(hf.get("use_sliding_window")), "true (sliding-window attention)"),
    }
    refuse_first(problems, where)


def config_from_hf(hf: dict, where: str = "config.json") -> dict:
    """The `model.model_config` fields (a dict for the config loader) of a Hugging Face config.json."""
    model_type = hf_model_type(hf, HF_MODEL_TYPES, where, "Llama-, Qwen2- or Qwen3-family")
    family, _, tied_default = CONFIG_TYPES[model_type]
    _refuse_unsupported(hf, model_type, where)
    return {
        "type": family,
        **common_fields(hf, where, tied_default),
        "qkv_has_bias": model_type == "qwen2",
        "use_qk_norm": model_type == "qwen3",
    }


def common_fields(hf: dict, where: str, tied_default: bool = False) -> dict:
    """The fields every Llama-architecture config.json gives the same way (shapes, norm, rotary, token ids); the
    MoE family (models/llama_moe/hf.py) reads them with this too."""
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [k for k in required if not isinstance(hf.get(k), int)]
    if missing:
        raise UserError(f"{where}: {', '.join(missing)} missing or not an integer")
    theta, scaling = _rope(hf, where)
    heads = hf["num_attention_heads"]
    fields = {
        "hidden_size": hf["hidden_size"],
        "num_layers": hf["num_hidden_layers"],
        "num_heads": heads,
        "n_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
        "intermediate_size": hf["intermediate_size"],
        "vocab_size": hf["vocab_size"],
        "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "theta": theta,
        "rope_scaling": scaling,
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", tied_default)),
    }
    if isinstance(hf.get("max_position_embeddings"), int):
        fields["max_position_embedding"] = hf["max_position_embeddings"]
        fields["seq_length"] = min(hf["max_position_embeddings"], 4096)  # a training default, not a limit
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = hf.get(key)
        if isinstance(value, list):  # Llama 3.1 Instruct lists several end tokens; the first is the usual EOS
            value = value[0] if value else None
        if isinstance(value, int):
            fields[key] = value
    return fields


def config_to_hf(mc: ModelConfig, dtype: str) -> dict:
    """A config.json that `transformers` reads back as the same model (written in the rope_scaling spelling, which
    transformers 4 and 5 both understand)."""
    model_type = {family: mt for mt, (family, _, _) in CONFIG_TYPES.items()}[mc.type]
    if mc.qkv_has_bias != (model_type == "qwen2") or mc.use_qk_norm != (model_type == "qwen3"):
        raise UserError(
            f"model_config: type {mc.type} with qkv_has_bias={mc.qkv_has_bias}, use_qk_norm={mc.use_qk_norm} has no "
            f"Hugging Face architecture (Llama: neither, Qwen2: q/k/v bias, Qwen3: q/k norm)"
        )
    hf = common_hf(mc, model_type, CONFIG_TYPES[model_type][1], dtype)
    if model_type == "llama":
        hf.update(attention_bias=False, mlp_bias=False)
    if model_type == "qwen2":
        hf.update(use_sliding_window=False, sliding_window=None)
    if model_type == "qwen3":
        hf.update(attention_bias=False)
    return hf


def common_hf(mc: ModelConfig, model_type: str, architecture: str, dtype: str) -> dict:
    """The config.json keys every Llama-architecture model writes the same way (the MoE family's too)."""
    rs = mc.rope_scaling
    scaling = None
    if rs.type == "llama3":
        scaling = {
            "rope_type": "llama3",
            "factor": rs.factor,
            "low_freq_factor": rs.low_freq_factor,
            "high_freq_factor": rs.high_freq_factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings,
        }
    elif rs.type != "none":
        raise UserError(f"model_config.rope_scaling.type={rs.type} has no {architecture} spelling: use none or llama3")
    return {
        **hf_sizes(mc, model_type, architecture),
        "hidden_act": "silu",
        "rms_norm_eps": mc.rms_norm_eps,
        "rope_theta": mc.theta,
        "rope_scaling": scaling,
        **hf_vocabulary(mc, dtype),
    }


def hf_sizes(mc: ModelConfig, model_type: str, architecture: str) -> dict:
    """config.json's first keys in every family's spelling: the architecture and the layer sizes."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": mc.hidden_size,
        "intermediate_size": mc.ffn_hidden_size,
        "num_hidden_layers": mc.num_layers,
        "num_attention_heads": mc.num_heads,
        "num_key_value_heads": mc.num_kv_heads,
        "head_dim": mc.dim_per_head,
    }


def hf_vocabulary(mc: ModelConfig, dtype: str) -> dict:
    """config.json's last keys in every family's spelling: positions, vocabulary, tying, special tokens, dtype."""
    return {
        "max_position_embeddings": mc.max_position_embedding or mc.seq_length,
        "vocab_size": mc.vocab_size,
        "tie_word_embeddings": mc.tie_word_embeddings,
        "bos_token_id": mc.bos_token_id,
        "eos_token_id": mc.eos_token_id,
        "pad_token_id": mc.pad_token_id,
        "torch_dtype": dtype,
    }
