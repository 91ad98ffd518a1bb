"""GLM-4's names in llama.cpp's GGUF files (its `glm4` architecture; interop/gguf_read.py and gguf_write.py
apply them), as llama.cpp's convert_hf_to_gguf.py `Glm4Model` writes them:

- the fused `gate_up_proj` [2 x intermediate, hidden] is `ffn_up` as it is (llama.cpp splits it at run time), so
  the GGUF tables name Hugging Face's fused tensor and hf.py splits it on import like a config.json checkpoint's;
- the post-block norms are `post_attention_norm` (after attention) and `post_ffw_norm` (after the MLP); the norm
  before the MLP is `ffn_norm`, as Llama's;
- q/k rows are written unpermuted: llama.cpp runs `glm4` with adjacent-pair rotary, the layout transformers' Glm4
  has already; `rope.dimension_count` is the rotary's width, int(head_dim x partial_rotary_factor).
"""

from __future__ import annotations

from meshformer.models.llama.gguf import GLOBAL_NAMES, LAYER_PARTS, QWEN2_PARTS
from meshformer.models.registry import GgufArch

GLM4_PARTS = {
    **{part: hf for part, hf in LAYER_PARTS.items() if part not in ("ffn_gate.weight", "ffn_up.weight")},
    **QWEN2_PARTS,  # q/k/v biases
    "ffn_up.weight": "mlp.gate_up_proj.weight",
    "post_attention_norm.weight": "post_self_attn_layernorm.weight",
    "post_ffw_norm.weight": "post_mlp_layernorm.weight",
}

GGUF_NAMES = {
    "glm4": GgufArch("Glm4ForCausalLM", "glm4", GLOBAL_NAMES, GLM4_PARTS, rotary_fraction_key="partial_rotary_factor"),
}
