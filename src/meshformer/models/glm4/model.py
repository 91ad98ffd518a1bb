"""GLM-4's decoder: Llama's modules (models/llama/model.py) with GLM's rotary layout and two more norms a layer.

transformers' Glm4 (modeling_glm4.py) differs from Llama in three ways, each taken here without a forward of its own
for attention:
- the rotary embedding turns only the first `rotary_width` channels of each query and key head, and turns adjacent
  pairs (x0, x1), (x2, x3), ... (GPT-J style) where Llama turns the two halves. `GlmRopeTables` gives Llama's
  attention that layout: its tables cover the rotary channels only, and its `rotate` de-interleaves them (evens,
  then odds) and applies Llama's half-split rotation, as DeepSeek's latent attention does (models/deepseek/
  rope_yarn.py). The rotated channels come out de-interleaved: they only ever meet another head's rotated
  channels, permuted the same way, in a dot product, so the scores are transformers' (and the cache keeps keys in
  that order too);
- each block's output is normed before it joins the residual stream (`post_self_attn_layernorm`,
  `post_mlp_layernorm`);
- the MLP's gate and up projections are one `gate_up_proj` on disk (gate first): here they stay Llama's separate
  `gate_proj` / `up_proj`, so tensor parallelism splits each by its own rows; hf.py splits and joins them, exactly.
q/k/v biases are Llama's `qkv_has_bias`; o_proj has none, as in Llama.
"""

from __future__ import annotations

import torch

from meshformer.config.schema import ModelConfig
from meshformer.dtypes import DTYPE
from meshformer.models.glm4.config import rotary_width
from meshformer.models.llama.model import DecoderLayer, RMSNorm, RopeTables, Transformer, apply_rotary
from meshformer.models.llama.model import tp_plan as llama_tp_plan


def glm_cos_sin(mc: ModelConfig, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [len, rotary_width]: frequencies theta^(-2i / rotary_width) repeated twice (the half-split layout the
    de-interleaved pairs are turned in)."""
    d = rotary_width(mc)
    inv_freq = 1.0 / (mc.theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    freqs = positions.to(torch.float64)[:, None] * inv_freq[None, :].to(positions.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_leading_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [batch, heads, seq, head_dim] with its first cos.shape[-1] channels turned as adjacent pairs (de-interleaved
    on the way) and the rest passed through."""
    width = cos.shape[-1]
    turned, rest = x[..., :width], x[..., width:]
    turned = turned.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
    return torch.cat([apply_rotary(turned, cos, sin), rest], dim=-1)


class GlmRopeTables(RopeTables):
    """Llama's position tables (slicing, per-row positions, generation past seq_length) over the rotary channels."""

    width_of = staticmethod(rotary_width)
    cos_sin = staticmethod(glm_cos_sin)
    rotate = staticmethod(rotate_leading_pairs)


class Glm4DecoderLayer(DecoderLayer):
    def __init__(self, mc: ModelConfig, layer_idx: int):
        super().__init__(mc, layer_idx)
        norm_dtype = DTYPE[mc.layernorm_compute_dtype]
        self.post_self_attn_layernorm = RMSNorm(mc.hidden_size, mc.rms_norm_eps, norm_dtype)
        self.post_mlp_layernorm = RMSNorm(mc.hidden_size, mc.rms_norm_eps, norm_dtype)

    def forward(self, x, rope, start: int = 0, cache=None, positions=None, mask=None):
        h = self.self_attn(self.input_layernorm(x), rope, start, cache, self.layer_idx, positions, mask)
        x = x + self.post_self_attn_layernorm(h)
        return x + self.post_mlp_layernorm(self.mlp(self.post_attention_layernorm(x)))


class Glm4Transformer(Transformer):
    decoder_layer = Glm4DecoderLayer
    rope_tables = GlmRopeTables


def tp_plan(model) -> dict[str, str]:
    """Llama's plan (q/k/v and gate/up column-parallel, o and down row-parallel) with the two extra norms
    replicated like the others."""
    plan = llama_tp_plan(model)
    plan.update({f"layers.*.{norm}": "norm" for norm in ("post_self_attn_layernorm", "post_mlp_layernorm")})
    return plan


def param_count(mc: ModelConfig) -> int:
    """Parameters of the whole model, counted on one meta-device layer (no memory is allocated)."""
    from meshformer.models.sizes import layered_param_count

    return layered_param_count(Glm4Transformer, mc)
