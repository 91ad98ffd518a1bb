"""Gemma 3's decoder (transformers' modeling_gemma3.py, text model) built from Llama's modules
(models/llama/model.py):

- RMSNorm scales by (1 + weight), computed in float32 as transformers does (`GemmaRMSNorm`); the norms sit before
  and after attention and before and after the feed-forward block, each output normed before it joins the residual;
  q and k are normed per head before rotary;
- the MLP is GeGLU: down(gelu_tanh(gate(x)) * up(x));
- embeddings are multiplied by sqrt(hidden_size) rounded to the embedding's dtype (transformers'
  Gemma3TextScaledWordEmbedding: its `embed_scale` buffer is cast to the weight's dtype before the product);
- attention scores are q.k x query_pre_attn_scalar ** -0.5 (`Attention.scale`);
- sliding layers see `sliding_window` keys and rotate with `rope_local_base_freq`, global layers see every key and
  rotate with `theta`, positions divided by `global_rope_scaling_factor` (transformers' linear rope scaling).

The two rotary tables live in one module, the model's `rope` (`Gemma3RopeTables`), which Transformer.forward hands
to every layer as it hands Llama's: each layer picks its kind's table, so pipeline stages (pieces of the model with
their own `rope`), packed rows (`rope.at(positions)`) and generation (`rope.slice`) need no code of their own here.
The sliding window is set on each sliding layer's attention at build, so training, context parallelism and the
rolling KV cache apply it as they do Mistral's.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from meshformer.dtypes import DTYPE
from meshformer.models.gemma3.config import Gemma3Config
from meshformer.models.llama.model import MLP, Attention, DecoderLayer, RMSNorm, RopeTables, Transformer
from meshformer.models.llama.model import tp_plan as llama_tp_plan


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) x (1 + weight), in compute_dtype (float32 by default), returned in the input dtype."""

    init_fill = 0.0  # a fresh model's norms are the identity, as transformers initialises them (models/init.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(self.compute_dtype)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.to(self.compute_dtype))).to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)  # the identity scale, as transformers initialises it


def norm(mc: Gemma3Config, dim: int) -> GemmaRMSNorm:
    return GemmaRMSNorm(dim, mc.rms_norm_eps, DTYPE[mc.layernorm_compute_dtype])


class ScaledEmbedding(nn.Embedding):
    """An embedding whose rows are multiplied by sqrt(hidden_size), the factor first rounded to the weight's dtype
    (a Python number of that exact value, so tensor parallelism's sharded lookup scales as a plain one does)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        scale = torch.tensor(self.embedding_dim**0.5, dtype=torch.float32).to(self.weight.dtype).item()
        return super().forward(ids) * scale


def gemma_cos_sin(mc, positions: torch.Tensor, dtype: torch.dtype, theta: float, factor: float):
    """Llama's half-split cos/sin tables with base `theta`, every frequency divided by `factor` (linear scaling)."""
    d = mc.dim_per_head
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)) / factor
    freqs = positions.to(torch.float64)[:, None] * inv_freq[None, :].to(positions.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class KindRopeTables(RopeTables):
    """One kind of layer's tables (RopeTables with its own base and linear factor)."""

    def __init__(self, mc: Gemma3Config, theta: float, factor: float):
        super().__init__(mc)
        self.cos_sin = partial(gemma_cos_sin, theta=theta, factor=factor)


class Gemma3RopeTables(nn.Module):
    """The model's `rope`: the global layers' tables (`full`) and the sliding layers' (`sliding`)."""

    def __init__(self, mc: Gemma3Config):
        super().__init__()
        self.full = KindRopeTables(mc, mc.theta, mc.global_rope_scaling_factor)
        self.sliding = KindRopeTables(mc, mc.rope_local_base_freq, 1.0)


class Gemma3Attention(Attention):
    """Llama's attention with (1 + weight) q/k norms, Gemma's score scale and the layer's window."""

    def __init__(self, mc: Gemma3Config, layer_idx: int):
        super().__init__(mc)
        self.q_norm, self.k_norm = norm(mc, self.hd), norm(mc, self.hd)
        self.window = mc.window_of(layer_idx)
        self.scale = mc.query_pre_attn_scalar**-0.5


class GeGLU(MLP):
    """down(gelu_tanh(gate(x)) * up(x)): transformers' gelu_pytorch_tanh."""

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Gemma3DecoderLayer(DecoderLayer):
    def __init__(self, mc: Gemma3Config, layer_idx: int):
        super().__init__(mc, layer_idx)
        self.sliding = mc.is_sliding(layer_idx)
        self.input_layernorm = norm(mc, mc.hidden_size)
        self.post_attention_layernorm = norm(mc, mc.hidden_size)
        self.pre_feedforward_layernorm = norm(mc, mc.hidden_size)
        self.post_feedforward_layernorm = norm(mc, mc.hidden_size)

    def make_attention(self, mc: Gemma3Config) -> nn.Module:
        return Gemma3Attention(mc, self.layer_idx)

    def make_mlp(self, mc: Gemma3Config, layer_idx: int) -> nn.Module:
        return GeGLU(mc)

    def forward(self, x, rope: Gemma3RopeTables, start: int = 0, cache=None, positions=None, mask=None):
        tables = rope.sliding if self.sliding else rope.full
        h = self.self_attn(self.input_layernorm(x), tables, start, cache, self.layer_idx, positions, mask)
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Transformer(Transformer):
    decoder_layer = Gemma3DecoderLayer
    rope_tables = Gemma3RopeTables

    def __init__(self, mc: Gemma3Config):
        super().__init__(mc)
        self.embed_tokens = ScaledEmbedding(mc.vocab_size, mc.hidden_size)
        self.norm = norm(mc, mc.hidden_size)


def tp_plan(model: nn.Module) -> dict[str, str]:
    """Llama's plan (models/llama/model.py) and the two feed-forward norms, on the residual stream like the others."""
    return {
        **llama_tp_plan(model),
        "layers.*.pre_feedforward_layernorm": "norm",
        "layers.*.post_feedforward_layernorm": "norm",
    }


def param_count(mc: Gemma3Config) -> int:
    """Parameters of the whole model from its config alone (equals the built model's; tested)."""
    h, hd, heads, kv, ffn = mc.hidden_size, mc.dim_per_head, mc.num_heads, mc.num_kv_heads, mc.ffn_hidden_size
    attn = 2 * h * heads * hd + 2 * h * kv * hd + 2 * hd  # q, o, k, v and the q/k norms
    layer = attn + 3 * h * ffn + 4 * h
    embed = mc.vocab_size * h * (1 if mc.tie_word_embeddings else 2)
    return embed + mc.num_layers * layer + h
