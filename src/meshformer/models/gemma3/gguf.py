"""Gemma 3's names and metadata in llama.cpp's GGUF files (architecture `gemma3`; interop/gguf_write.py and
gguf_read.py apply them), as llama.cpp's convert_hf_to_gguf.py `Gemma3Model` writes them.

- Every norm weight is stored plus 1 (`norm_shift`): llama.cpp multiplies by the stored factor, Gemma by (1 + w).
  Read back, a float32 norm weight is kept to 2**-23 absolute, not bit for bit; every other tensor is.
- The global layers' rotary base is `rope.freq_base`, their linear scaling `rope.scaling.*`; the window is
  `attention.sliding_window`, the sliding layers' base `rope.freq_base_swa`.
- llama.cpp fixes what Gemma 3's checkpoints have: every 6th layer global, the sliding layers' base 10000 (older
  builds ignore the key), scores scaled by 1/sqrt(head_dim). A config that differs would compute something else
  there, so its export is refused in one line naming the field.
"""

from __future__ import annotations

from meshformer.errors import UserError
from meshformer.models.gemma3.config import FULL, SLIDING
from meshformer.models.llama.gguf import GLOBAL_NAMES
from meshformer.models.registry import GgufArch

LAYER_PARTS = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
PATTERN, LOCAL_BASE = 6, 10_000.0  # what llama.cpp's gemma3 assumes


def write_metadata(writer, gguf, config: dict) -> None:
    """The window, the sliding layers' base and the global layers' linear scaling; refuses what llama.cpp fixes."""
    layers, head_dim = config["num_hidden_layers"], config["head_dim"]
    kinds = [SLIDING if (i + 1) % PATTERN else FULL for i in range(layers)]
    refusals = {
        "layer_types": (config.get("layer_types") != kinds, f"every {PATTERN}th layer global"),
        "rope_local_base_freq": (config.get("rope_local_base_freq") != LOCAL_BASE, f"{LOCAL_BASE:g}"),
        "query_pre_attn_scalar": (config.get("query_pre_attn_scalar") != head_dim, f"head_dim ({head_dim})"),
    }
    for field, (bad, fixed) in refusals.items():
        if bad:
            raise UserError(
                f"GGUF export: model_config.{field}={config.get(field)!r}: llama.cpp's gemma3 assumes {fixed}; "
                f"export this model as safetensors instead"
            )
    if config.get("sliding_window") is not None:
        writer.add_sliding_window(config["sliding_window"])
    writer.add_key_value("gemma3.rope.freq_base_swa", LOCAL_BASE, gguf.GGUFValueType.FLOAT32)
    scaling = config.get("rope_scaling") or {}
    if scaling:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])


def read_config(meta: dict, config: dict) -> dict:
    """Gemma 3's config.json keys from the metadata (llama.cpp's fixed choices where the file has no key)."""
    window = meta.get("gemma3.attention.sliding_window")
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": None if window is None else int(window),
        "sliding_window_pattern": PATTERN,
        "rope_local_base_freq": float(meta.get("gemma3.rope.freq_base_swa", LOCAL_BASE)),
        "query_pre_attn_scalar": config["head_dim"],
    }


GGUF_NAMES = {
    "gemma3": GgufArch(
        "Gemma3ForCausalLM",
        "gemma3_text",
        GLOBAL_NAMES,
        LAYER_PARTS,
        norm_shift=1.0,
        write_metadata=write_metadata,
        read_config=read_config,
    )  # fmt: skip
}
