"""Multi-head latent attention (DeepSeek-V2/V3) as a plain module, and the latent cache that makes decoding cheap.

Queries: q_proj, or the low-rank q_a_proj -> q_a_layernorm -> q_b_proj (q_lora_rank); each head's query is a part
without rotary (qk_nope_head_dim) and a rotary part (qk_rope_head_dim). Keys and values come from one compressed
latent per token: kv_a_proj_with_mqa gives the latent (kv_lora_rank, then kv_a_layernorm) and one rotary key shared
by every head; kv_b_proj expands the latent into each head's key part without rotary and its value (v_head_dim).
Softmax scale qk_head_dim^-0.5 (times YaRN's mscale^2, rope_yarn.py), softmax in fp32 as models/attention.py does.
Parameter names are transformers' `DeepseekV3Attention`'s.

Training and a prompt's prefill expand the latent (every head's keys and values, then causal attention). With a
cache, what is stored per token is the latent and the rotary key, kv_lora_rank + qk_rope_head_dim numbers for all
heads together (576 for DeepSeek-V3, against 128 heads x (192 + 128) expanded), and decoding attends in the latent
space (the "absorbed" form of the DeepSeek-V2 paper): each head's query meets W_k^T of kv_b_proj first, so scores are
q_nope W_k c + q_rope k_rope over the cached c, the softmax-weighted latents go through W_v after, and no key or
value is ever expanded for the cached tokens. That is multi-query attention with one 'head' of width
kv_lora_rank + qk_rope_head_dim whose values are its first kv_lora_rank channels.

Two seams a parallel technique may replace on an instance, as Llama's `Attention.attend`: `attend`, the causal
attention of training and prefill, and `gather_latent`, through which training's per-token entries [latent, rotary
key] pass before kv_b_proj expands them (the identity here; context parallelism all-gathers them over its ranks,
576 numbers a token for DeepSeek-V3 instead of the expanded keys and values: parallel/context_parallel.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshformer.config.schema import ModelConfig
from meshformer.dtypes import DTYPE
from meshformer.models.attention import causal_attention
from meshformer.models.deepseek.rope_yarn import rotate, softmax_scale
from meshformer.models.llama.model import RMSNorm, RopeTables


class LatentCache:
    """Per layer, per token: [latent (kv_lora_rank), rotary key (qk_rope_head_dim)] in `k[layer]` [batch, 1, max_len,
    kv_lora_rank + qk_rope_head_dim]; `document_layout` (models/llama/model.py) reads its length, `max_len`, as a
    KVCache's. There is no separate value tensor: the values are the latent, the first kv_lora_rank channels."""

    def __init__(self, n_layers: int, batch: int, max_len: int, width: int, dtype: torch.dtype, device):
        self.k = [torch.zeros(batch, 1, max_len, width, dtype=dtype, device=device) for _ in range(n_layers)]
        self.max_len = max_len
        self.pos = 0
        self.documents: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None

    def update(self, idx: int, entries: torch.Tensor) -> torch.Tensor:
        """Store entries [batch, 1, new, width] after the tokens already there; all of this layer's so far."""
        end = self.pos + entries.shape[2]
        self.k[idx][:, :, self.pos : end] = entries
        return self.k[idx][:, :, :end]


def _same(entries: torch.Tensor) -> torch.Tensor:
    return entries


class LatentAttention(nn.Module):
    absorb = True  # decode in the latent space (False: expand the cached latents, the reference the tests compare)
    # Training's and prefill's causal attention (q, k, v, mask, scale) -> out, and training's entries [b, 1, s,
    # kv_lora_rank + qk_rope_head_dim] -> those kv_b_proj expands: seams a parallel technique replaces per instance
    attend = staticmethod(causal_attention)
    gather_latent = staticmethod(_same)

    def __init__(self, mc: ModelConfig):
        super().__init__()
        self.n_heads = mc.num_heads
        self.nope, self.rope_dim, self.v_dim = mc.qk_nope_head_dim, mc.qk_rope_head_dim, mc.v_head_dim
        self.rank = mc.kv_lora_rank
        self.qk_dim = mc.qk_head_dim
        self.interleaved = mc.rope_interleave
        self.scale = softmax_scale(mc)
        norm_dtype = DTYPE[mc.layernorm_compute_dtype]
        h, heads = mc.hidden_size, mc.num_heads
        if mc.q_lora_rank is None:
            self.q_proj = nn.Linear(h, heads * self.qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, mc.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(mc.q_lora_rank, mc.rms_norm_eps, norm_dtype)
            self.q_b_proj = nn.Linear(mc.q_lora_rank, heads * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.rank, mc.rms_norm_eps, norm_dtype)
        # An identity the rotary key passes through: where tensor parallelism sums its gradient, which each rank's
        # heads only contribute part of (models/deepseek/model.py tp_plan)
        self.rope_key = nn.Identity()
        self.kv_b_proj = nn.Linear(self.rank, heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, h, bias=False)

    def forward(
        self,
        x,
        rope: RopeTables,
        start: int = 0,
        cache: LatentCache | None = None,
        layer_idx: int = 0,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ):
        """The signature of Llama's Attention.forward: positions [b, s] and mask [b, 1, s, keys] (True: may attend)
        come together from `document_layout`."""
        b, s, _ = x.shape
        cos, sin = rope.slice(start, s) if positions is None else rope.at(positions)
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        # -1 instead of n_heads: under tensor parallelism each rank holds a slice of the heads
        q_nope, q_rope = q.view(b, s, -1, self.qk_dim).transpose(1, 2).split([self.nope, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)[:, None]  # [b, 1, s, rank]: one latent for every head
        q_rope = rotate(q_rope, cos, sin, self.interleaved)
        k_rope = rotate(self.rope_key(k_rope)[:, None], cos, sin, self.interleaved)
        if cache is None:  # training: expanded, as one matmul per head, from the entries `gather_latent` passes
            entries = self.gather_latent(torch.cat([latent, k_rope], dim=-1))
            latent, k_rope = entries.split([self.rank, self.rope_dim], dim=-1)
            out = self._expanded(q_nope, q_rope, latent, k_rope, mask)
        elif cache.pos == 0:  # a prompt's prefill: expanded, as in training
            cache.update(layer_idx, torch.cat([latent, k_rope], dim=-1))
            out = self._expanded(q_nope, q_rope, latent, k_rope, mask)
        else:
            entries = cache.update(layer_idx, torch.cat([latent, k_rope], dim=-1))
            if mask is None:  # queries at positions pos..pos+s-1 see every cached key up to their own position
                q_pos = torch.arange(cache.pos, cache.pos + s, device=x.device)[:, None]
                mask = torch.arange(entries.shape[2], device=x.device)[None, :] <= q_pos
            if self.absorb and isinstance(self.kv_b_proj, nn.Linear):  # a LoRA-wrapped kv_b_proj is expanded
                out = self._absorbed(q_nope, q_rope, entries, mask)
            else:
                cached_latent, cached_rope = entries.split([self.rank, self.rope_dim], dim=-1)
                out = self._expanded(q_nope, q_rope, cached_latent, cached_rope, mask, causal=False)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))

    def _expanded(self, q_nope, q_rope, latent, k_rope, mask, causal: bool = True) -> torch.Tensor:
        """Every head's keys and values from the latents [b, 1, t, rank] -> attention out [b, heads, s, v_dim]."""
        b, _, t, _ = latent.shape
        kv = self.kv_b_proj(latent[:, 0]).view(b, t, -1, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        if causal:
            return self.attend(q, k, v, mask, scale=self.scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)

    def _absorbed(self, q_nope, q_rope, entries, mask) -> torch.Tensor:
        """Attention in the latent space over the cached entries [b, 1, t, rank + rope] -> [b, heads, s, v_dim]."""
        w = self.kv_b_proj.weight
        w = w.to_local() if hasattr(w, "to_local") else w  # this rank's heads under tensor parallelism
        w = w.view(-1, self.nope + self.v_dim, self.rank)  # [heads, nope + v, rank]
        w_k, w_v = w[:, : self.nope], w[:, self.nope :]
        q_latent = torch.einsum("bhsn,hnr->bhsr", q_nope, w_k)
        q = torch.cat([q_latent, q_rope], dim=-1)  # against [latent, rotary key]: one shared 'head'
        values = entries[..., : self.rank]
        out = F.scaled_dot_product_attention(q, entries, values, attn_mask=mask, scale=self.scale, enable_gqa=True)
        return torch.einsum("bhsr,hvr->bhsv", out, w_v)
