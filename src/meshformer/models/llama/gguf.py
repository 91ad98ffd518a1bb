"""The Llama family's names in llama.cpp's GGUF files, per GGUF architecture (interop/gguf_read.py and
gguf_write.py apply them).

llama.cpp's converter permutes the rows of q_proj and k_proj of the `llama` architecture so that its rotary
embedding rotates adjacent pairs (GPT-J style) instead of the two halves of each head (GPT-NeoX style, what
`transformers` and meshformer use); Qwen2/Qwen3 files are written unpermuted (llama.cpp runs them with NeoX rotary).
"""

from __future__ import annotations

from meshformer.models.registry import GgufArch

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# The part of a `blk.N.` name after the layer number; anything else is refused.
LAYER_PARTS = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
QWEN2_PARTS = {
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
}
QWEN3_PARTS = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}

GGUF_NAMES = {
    "llama": GgufArch("LlamaForCausalLM", "llama", GLOBAL_NAMES, LAYER_PARTS, permute_rotary=True),
    "qwen2": GgufArch("Qwen2ForCausalLM", "qwen2", GLOBAL_NAMES, {**LAYER_PARTS, **QWEN2_PARTS}),
    "qwen3": GgufArch("Qwen3ForCausalLM", "qwen3", GLOBAL_NAMES, {**LAYER_PARTS, **QWEN3_PARTS}),
}
