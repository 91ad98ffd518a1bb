"""GPT-OSS's decoder: Llama's layers (models/llama/model.py) with biased attention, learned sinks, a per-layer window
and an MoE block (models/moe/) on every layer; YaRN rotary tables.

transformers' GptOssAttention is LlamaAttention with biases on q/k/v and o, a sink logit per head joining each
query's softmax as one more column of value zero (models/attention.py), and `sliding_window` on the layers
`layer_types` calls sliding_attention. The window and sinks are set on each attention module at build, so training,
packed rows, context parallelism and generation (a ring of `window` keys per sliding layer: models/kv_cache.py)
apply them with no code of their own here. GptOssMLP is a router Linear with a bias, top-k of its logits and a softmax
over those k (the same weights as a softmax over all experts renormalised over the k chosen: moe_config's
norm_topk_prob), then biased experts with the clamped SwiGLU: MoEBlock with moe_config's router_bias, expert_bias and
expert_activation. Parameter names are ours (`mlp.gate`, stacked `mlp.experts.gate_proj` ...); hf.py maps
Hugging Face's (`mlp.router`, interleaved `mlp.experts.gate_up_proj`) both ways.

YaRN (transformers' `_compute_yarn_parameters`): inverse frequencies blend the interpolated (divided by `factor`) and
original ones along a linear ramp between the correction dimensions of beta_fast and beta_slow rotations over the
original context (rounded outwards only with `truncate`), and cos/sin are multiplied by 0.1 ln(factor) + 1.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from meshformer.config.schema import ModelConfig
from meshformer.models.llama.model import DecoderLayer, RopeTables, Transformer
from meshformer.models.moe import MoEBlock


def yarn_inv_freq(mc: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2] in float32 as transformers computes them, the cos/sin factor)."""
    d, base, rs = mc.dim_per_head, mc.theta, mc.rope_scaling
    pos_freqs = base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    if rs.type != "yarn":
        return 1.0 / pos_freqs, 1.0

    def correction_dim(rotations: float) -> float:
        return (d * math.log(rs.original_max_position_embeddings / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rs.beta_fast), correction_dim(rs.beta_slow)
    if rs.yarn_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    kept = 1 - ramp  # the share of each frequency left as it was
    inv = (1.0 / (rs.factor * pos_freqs)) * (1 - kept) + (1.0 / pos_freqs) * kept
    return inv, 1.0 if rs.factor <= 1 else 0.1 * math.log(rs.factor) + 1.0


def yarn_cos_sin(mc: ModelConfig, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [len, head_dim] (frequencies repeated twice, the half-split layout), times YaRN's factor; float32
    products as transformers computes them."""
    inv, factor = yarn_inv_freq(mc)
    freqs = positions.to(torch.float32)[:, None] * inv.to(positions.device)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)


class GptOssRopeTables(RopeTables):
    cos_sin = staticmethod(yarn_cos_sin)


class GptOssDecoderLayer(DecoderLayer):
    def make_attention(self, mc: ModelConfig) -> nn.Module:
        attention = super().make_attention(mc)
        attention.o_proj = nn.Linear(mc.num_heads * mc.dim_per_head, mc.hidden_size, bias=True)
        attention.sinks = nn.Parameter(torch.empty(mc.num_heads))
        attention.window = mc.window_of(self.layer_idx)
        return attention

    def make_mlp(self, mc: ModelConfig, layer_idx: int) -> nn.Module:
        return MoEBlock(mc, layer_idx)


class GptOssTransformer(Transformer):
    decoder_layer = GptOssDecoderLayer
    rope_tables = GptOssRopeTables


def param_count(mc: ModelConfig) -> int:
    """Parameters of the whole model, counted on one meta-device layer of each kind (no memory is allocated)."""
    from meshformer.models.sizes import layered_param_count

    return layered_param_count(GptOssTransformer, mc)


def tp_plan(model: nn.Module) -> dict[str, str]:
    """The MoE Llama family's plan (attention and the o_proj bias as Llama's; router and routed experts whole, biases
    included), with each attention's sinks split by head as q_proj splits the heads (parallel/tp.py)."""
    from meshformer.models.llama_moe.model import tp_plan as moe_llama_tp_plan

    return {**moe_llama_tp_plan(model), "layers.*.self_attn": "attention_heads"}
