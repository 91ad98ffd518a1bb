"""Mistral's Hugging Face `config.json` <-> `model.model_config`: Llama's keys (models/llama/hf.py `common_fields` /
`common_hf`) plus `sliding_window`, null (global attention, Mistral 7B v0.2/v0.3) or the keys each query sees
(v0.1: 4096). A window at least as long as the text computes plain causal attention, so it is kept as given.
What Mistral's model cannot be (another activation, biases) is refused in one line naming the key.

GGUF: llama.cpp converts MistralForCausalLM as its `llama` architecture and applies no sliding window there, so a
Mistral checkpoint has no GGUF names: exporting one is refused (interop/gguf_write.py names the architecture).
"""

from __future__ import annotations

from meshformer.config.schema import ModelConfig
from meshformer.errors import UserError
from meshformer.models.llama.hf import common_fields, common_hf, refuse_first

HF_MODEL_TYPES = {"mistral": "MistralForCausalLM"}


def _window(hf: dict, where: str) -> int | None:
    window = hf.get("sliding_window")
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise UserError(f"{where}: sliding_window={window!r} must be a positive number of keys, or null (global)")
    return window


def config_from_hf(hf: dict, where: str = "config.json") -> dict:
    """The `model.model_config` fields of a MistralForCausalLM config.json."""
    act = hf.get("hidden_act", "silu")
    problems = {
        "hidden_act": (act != "silu", f"{act!r} (Mistral's MLP is SwiGLU with silu)"),
        "attention_bias": (bool(hf.get("attention_bias")), "true"),
        "mlp_bias": (bool(hf.get("mlp_bias")), "true"),
    }
    refuse_first(problems, where, "Mistral model")
    return {"type": "MistralConfig", **common_fields(hf, where), "sliding_window": _window(hf, where)}


def config_to_hf(mc: ModelConfig, dtype: str) -> dict:
    """A config.json transformers reads back as the same MistralForCausalLM."""
    if mc.qkv_has_bias or mc.use_qk_norm:
        raise UserError(
            f"model_config: type {mc.type} with qkv_has_bias={mc.qkv_has_bias}, use_qk_norm={mc.use_qk_norm} has no "
            f"MistralForCausalLM spelling (Mistral has neither)"
        )
    return {**common_hf(mc, "mistral", "MistralForCausalLM", dtype), "sliding_window": mc.sliding_window}
