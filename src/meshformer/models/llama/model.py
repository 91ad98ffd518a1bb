"""Llama-family decoder (Llama 2/3, Qwen2, Qwen3; Mistral builds on it) as plain `nn.Module`s.

No parallel code lives here: tensor, pipeline and data parallelism are applied from outside
(`meshformer.parallel`). Parameter names follow Hugging Face's `LlamaForCausalLM` minus the `model.` prefix,
and rotary embeddings use the same half-split layout, so weight conversion is a renaming.

Packed samples (several documents per row) pass `documents`, a document index per position: attention then stays
inside each document (a block-diagonal causal mask through SDPA) and rotary positions restart at each document, so
a packed row computes what each sample would alone. Batched generation uses the same mechanism for left padding.

Pipeline stages are made by deleting modules: `embed_tokens`, `norm` and `lm_head` may be None and `layers`
is a ModuleDict keyed by the global layer index, so names (and checkpoints) stay stable across layouts.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from meshformer.config.schema import ModelConfig
from meshformer.dtypes import DTYPE
from meshformer.models.attention import causal_attention, document_positions, sdpa, window_band
from meshformer.models.kv_cache import KVCache


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in `compute_dtype` (float32 by default), returned in the input dtype."""

    def __init__(self, dim: int, eps: float, compute_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.compute_dtype = compute_dtype
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(self.compute_dtype)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(self.compute_dtype) * h).to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_inv_freq(mc: ModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies, with optional llama3 frequency-dependent scaling."""
    d = mc.dim_per_head
    inv_freq = 1.0 / (mc.theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rs = mc.rope_scaling
    if rs.type == "llama3":
        low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
        high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor
        )
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
        mid = (1 - smooth) * inv_freq / rs.factor + smooth * inv_freq
        is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv_freq = torch.where(is_mid, mid, scaled)
    return inv_freq


def rope_cos_sin(mc: ModelConfig, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape [len, head_dim] (the half-split layout: frequencies repeated twice)."""
    freqs = positions.to(torch.float64)[:, None] * rope_inv_freq(mc)[None, :].to(positions.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, heads, seq, head_dim]; rotate-half formulation, computed in the tables' dtype.

    x * cos + cat([-x2, x1]) * sin, written as the halves swapped (a flip over an axis of two) times sin with its
    first half negated: the same products bit for bit, but without the cat Inductor's backward fuses into one
    pass, where the cat's gradient (two slices padded back to full width) left fp32 intermediates per layer
    (a faster compiled bf16 step on a CPU: docs/benchmarks.md).
    """
    xc = x.to(cos.dtype)
    half = x.shape[-1] // 2
    signed_sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
    swapped = xc.unflatten(-1, (2, half)).flip(-2).flatten(-2)
    return (xc * cos + swapped * signed_sin).to(x.dtype)


class RopeTables(nn.Module):
    """cos/sin tables for positions [0, seq_length) kept as non-persistent buffers.

    Attention slices them by its own input length, which is the full sequence even when sequence parallelism
    shards the activations between layers.
    """

    # A family with another rotary part (latent attention's) gives its width and tables, and one with another
    # rotary layout (a rotated fraction of each head, adjacent pairs) how a head is rotated with them
    width_of = staticmethod(lambda mc: mc.dim_per_head)
    cos_sin = staticmethod(rope_cos_sin)
    rotate = staticmethod(apply_rotary)  # (x [batch, heads, seq, head_dim], cos, sin) -> x rotated

    def __init__(self, mc: ModelConfig):
        super().__init__()
        self.config = mc
        self.dtype = DTYPE[mc.rotary_dtype]
        width = self.width_of(mc)
        self.register_buffer("cos", torch.empty(mc.seq_length, width, dtype=self.dtype), persistent=False)
        self.register_buffer("sin", torch.empty(mc.seq_length, width, dtype=self.dtype), persistent=False)

    def reset_buffers(self) -> None:
        """Fill the tables (after the model moved off the meta device; models/init.py calls every module's
        `reset_buffers`)."""
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Fill the tables (after the model moved off the meta device)."""
        cos, sin = self.cos_sin(self.config, torch.arange(self.config.seq_length, device=self.cos.device), self.dtype)
        self.cos.copy_(cos)
        self.sin.copy_(sin)

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [batch, 1, seq, head_dim] of per-row positions [batch, seq] (packed documents, padded batches)."""
        if int(positions.max()) < self.cos.shape[0]:
            return self.cos[positions][:, None], self.sin[positions][:, None]
        cos, sin = self.cos_sin(self.config, positions.flatten(), self.dtype)
        return cos.view(*positions.shape, -1)[:, None], sin.view(*positions.shape, -1)[:, None]

    def slice(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        if start + length <= self.cos.shape[0]:
            return self.cos[start : start + length], self.sin[start : start + length]
        positions = torch.arange(start, start + length, device=self.cos.device)  # generation past seq_length
        return self.cos_sin(self.config, positions, self.dtype)


class Attention(nn.Module):
    # Training's attention over whole rows (q, k, v, mask) -> out; a parallel technique may replace it on an instance
    # (context parallelism attends from local queries to keys gathered over its ranks: parallel/context_parallel.py).
    attend = staticmethod(causal_attention)

    def __init__(self, mc: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = mc.num_heads, mc.num_kv_heads, mc.dim_per_head
        # Building blocks a family sets per layer (models/attention.py): a sliding window (a query sees its `window`
        # latest keys, itself included; None: global), learned sink logits, a Parameter [heads] (GPT-OSS), and the
        # softmax scale of q.k (None: 1/sqrt(head_dim); a family whose scores use another scale sets it)
        self.window: int | None = None
        self.scale: float | None = None
        self.register_parameter("sinks", None)
        self.q_proj = nn.Linear(mc.hidden_size, self.n_heads * self.hd, bias=mc.qkv_has_bias)
        self.k_proj = nn.Linear(mc.hidden_size, self.n_kv * self.hd, bias=mc.qkv_has_bias)
        self.v_proj = nn.Linear(mc.hidden_size, self.n_kv * self.hd, bias=mc.qkv_has_bias)
        self.o_proj = nn.Linear(self.n_heads * self.hd, mc.hidden_size, bias=False)
        norm_dtype = DTYPE[mc.layernorm_compute_dtype]
        self.q_norm = RMSNorm(self.hd, mc.rms_norm_eps, norm_dtype) if mc.use_qk_norm else None
        self.k_norm = RMSNorm(self.hd, mc.rms_norm_eps, norm_dtype) if mc.use_qk_norm else None

    def forward(
        self,
        x,
        rope: "RopeTables",
        start: int = 0,
        cache: KVCache | None = None,
        layer_idx: int = 0,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ):
        """positions [b, s] and mask [b, 1, s, keys] (True: may attend) come together from `document_layout`."""
        b, s, _ = x.shape
        cos, sin = rope.slice(start, s) if positions is None else rope.at(positions)
        # -1 instead of n_heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.q_proj(x).view(b, s, -1, self.hd)
        k = self.k_proj(x).view(b, s, -1, self.hd)
        v = self.v_proj(x).view(b, s, -1, self.hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = rope.rotate(q, cos, sin), rope.rotate(k, cos, sin)
        if cache is not None:
            key_positions = cache.key_positions(layer_idx, s, x.device)
            k, v = cache.update(layer_idx, k, v)
        if cache is None or (cache.pos == 0 and mask is None):  # training, a prompt's prefill
            out = self.attend(q, k, v, mask, **self.attend_options())
        else:  # queries at positions pos..pos+s-1 see the cached keys up to their own position (within the window)
            allowed = window_band(torch.arange(cache.pos, cache.pos + s, device=x.device), key_positions, self.window)
            if mask is not None:  # document_layout's mask: a column per position; a ring keeps some of them
                mask = mask if mask.shape[-1] == key_positions.shape[0] else mask.index_select(-1, key_positions)
            out = sdpa(q, k, v, allowed if mask is None else mask & allowed, self.scale, sinks=self.local_sinks())
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))

    def attend_options(self) -> dict:
        """The window, sinks and scale for `attend`, only those set (context parallelism's installed `attend` takes
        them too, banding the global positions)."""
        options = {} if self.window is None else {"window": self.window}
        options = options if self.scale is None else {**options, "scale": self.scale}
        return options if self.sinks is None else {**options, "sinks": self.local_sinks()}

    def local_sinks(self) -> torch.Tensor | None:
        """The sinks of the heads this module computes (their shard under tensor parallelism, which splits the
        heads: parallel/tp.py `attention_heads`)."""
        return self.sinks.to_local() if hasattr(self.sinks, "to_local") else self.sinks


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, mc: ModelConfig, ffn: int | None = None):
        super().__init__()
        ffn = ffn or mc.ffn_hidden_size
        self.gate_proj = nn.Linear(mc.hidden_size, ffn, bias=False)
        self.up_proj = nn.Linear(mc.hidden_size, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, mc.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, mc: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        norm_dtype = DTYPE[mc.layernorm_compute_dtype]
        self.input_layernorm = RMSNorm(mc.hidden_size, mc.rms_norm_eps, norm_dtype)
        self.self_attn = self.make_attention(mc)
        self.post_attention_layernorm = RMSNorm(mc.hidden_size, mc.rms_norm_eps, norm_dtype)
        self.mlp = self.make_mlp(mc, layer_idx)

    def make_attention(self, mc: ModelConfig) -> nn.Module:
        """The attention block (a latent-attention family returns its own, with this forward's signature)."""
        return Attention(mc)

    def make_mlp(self, mc: ModelConfig, layer_idx: int) -> nn.Module:
        """The feed-forward block of layer `layer_idx` (an MoE family returns its expert block where it is sparse)."""
        return MLP(mc)

    def forward(self, x, rope: "RopeTables", start: int = 0, cache: KVCache | None = None, positions=None, mask=None):
        x = x + self.self_attn(self.input_layernorm(x), rope, start, cache, self.layer_idx, positions, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """Causal LM: tokens -> logits. Any of embed_tokens / norm / lm_head may be removed for pipeline stages."""

    # The tied output projection's matmul (F.linear's signature); a kernel choice may replace it on an instance
    # (backends/cpu.py), as it replaces the nn.Linear modules' forward.
    tied_head_linear = staticmethod(F.linear)
    decoder_layer = DecoderLayer  # a family with other layers (MoE) subclasses with its own
    rope_tables = RopeTables  # ... and with another rotary part (latent attention) its tables

    def __init__(self, mc: ModelConfig):
        super().__init__()
        self.config = mc
        self.embed_tokens = nn.Embedding(mc.vocab_size, mc.hidden_size)
        self.layers = nn.ModuleDict({str(i): self.decoder_layer(mc, i) for i in range(mc.num_layers)})
        self.norm = RMSNorm(mc.hidden_size, mc.rms_norm_eps, DTYPE[mc.layernorm_compute_dtype])
        # With tied embeddings the output projection reuses embed_tokens.weight (see output_weight()).
        self.lm_head = None if mc.tie_word_embeddings else nn.Linear(mc.hidden_size, mc.vocab_size, bias=False)
        self.rope = self.rope_tables(mc)

    def forward(
        self,
        h: torch.Tensor,
        cache: KVCache | None = None,
        documents: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """h: token ids [batch, seq] on the first stage, hidden states [batch, seq, hidden] after it.
        documents: [batch, seq] document index of every position (None: each row is one document).
        positions [batch, seq] and mask [batch, 1, seq, keys]: an explicit layout instead of `documents` (the rotary
        position of every token and which keys each may attend); the mask goes to the attention blocks as it is, so
        an installed `Attention.attend` may take another form of it (context parallelism's KeyLayout)."""
        start = cache.pos if cache is not None else 0
        if positions is None and (documents is not None or (cache is not None and cache.documents is not None)):
            positions, mask = document_layout(h.shape[0], h.shape[1], documents, cache, h.device)
        if self.embed_tokens is not None:
            h = self.embed_tokens(h)
        for layer in self.layers.values():
            h = layer(h, self.rope, start, cache, positions, mask)
        if cache is not None:
            cache.pos += h.shape[1]
        if self.norm is not None:
            h = self.norm(h)
        if self.lm_head is not None:
            h = self.lm_head(h)
        elif self.config.tie_word_embeddings and self.embed_tokens is not None and self.norm is not None:
            h = self.tied_head_linear(h, self.embed_tokens.weight)
        return h

    def tp_plan(self) -> dict[str, str]:
        """This model's tensor-parallel plan, as its family in the registry gives it (the planner asks pieces)."""
        from meshformer.models.registry import family_of

        return family_of(self.config).tp_plan(self)

    def new_kv_cache(self, batch: int, max_len: int) -> KVCache:
        """A cache for `max_len` tokens; a layer whose attention has a sliding window keeps only its window."""
        p = next(self.parameters())
        mc = self.config
        windows: list[int | None] = [None] * mc.num_layers
        for i, layer in self.layers.items():
            windows[int(i)] = getattr(layer.self_attn, "window", None)
        return KVCache(mc.num_layers, batch, mc.num_kv_heads, max_len, mc.dim_per_head, p.dtype, p.device, windows)


# What context parallelism (parallel/context_parallel.py) installs on this attention: every family built on it
CP_ATTENTION = {Attention: {"attend": "attend"}}


def tp_plan(model: nn.Module) -> dict[str, str]:
    """How tensor parallelism splits this family: module-path globs -> style names (parallel/tp.py says what
    each name does). Megatron's recipe: q/k/v and gate/up column-parallel, o and down row-parallel, so each
    sub-block needs one reduction; embedding and head split by vocabulary; norms replicated. Modules this
    piece lacks (a pipeline stage, no q/k norm) are skipped."""
    layer = {
        "input_layernorm": "norm",
        "self_attn": "gather_sequence",  # attention needs every position of the sequence
        "self_attn.q_proj": "colwise",
        "self_attn.k_proj": "colwise",
        "self_attn.v_proj": "colwise",
        "self_attn.o_proj": "rowwise",
        "self_attn.q_norm": "head_norm",
        "self_attn.k_norm": "head_norm",
        "post_attention_layernorm": "norm",
        "mlp": "gather_sequence",
        "mlp.gate_proj": "colwise",
        "mlp.up_proj": "colwise",
        "mlp.down_proj": "rowwise",
    }
    return {
        "embed_tokens": "vocab_embedding",
        # Tied weights: the output projection is F.linear(h, embed_tokens.weight) in Transformer.forward.
        "norm": "norm_to_head" if model.config.tie_word_embeddings else "norm",
        "lm_head": "vocab_head",
        **{f"layers.*.{path}": style for path, style in layer.items()},
    }


def document_layout(
    b: int, s: int, documents: torch.Tensor | None, cache: KVCache | None, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rotary positions [b, s], attention mask [b, 1, s, keys]) for queries that may only see earlier tokens of
    their own document. With a cache, `documents` is given for the first call (a left-padded prompt batch: the
    padding is a document of its own) and later tokens continue each row's last document."""
    start = cache.pos if cache is not None else 0
    if cache is None:
        positions, keys = document_positions(documents), documents
    else:
        if cache.documents is None:
            if start:
                raise ValueError("documents must be given with the first tokens of a cache")
            size = cache.max_len
            cache.documents = torch.zeros(b, size, dtype=torch.long, device=device)
            cache.positions = torch.zeros(b, size, dtype=torch.long, device=device)
        if documents is None:  # continue the last document of each row
            documents = cache.documents[:, start - 1 : start].expand(b, s)
            positions = cache.positions[:, start - 1 : start] + 1 + torch.arange(s, device=device)
        elif start == 0:
            positions = document_positions(documents)
        else:
            raise ValueError("documents may only be given with the first tokens of a cache")
        cache.documents[:, start : start + s] = documents
        cache.positions[:, start : start + s] = positions
        keys = cache.documents[:, : start + s]
    queries = torch.arange(start, start + s, device=device)
    causal = torch.arange(keys.shape[1], device=device)[None, :] <= queries[:, None]
    return positions, ((documents[:, :, None] == keys[:, None, :]) & causal)[:, None]


def num_params(model: nn.Module, exclude_embedding: bool = False) -> int:
    n = sum(p.numel() for p in model.parameters())
    if exclude_embedding and getattr(model, "embed_tokens", None) is not None:
        n -= model.embed_tokens.weight.numel()
    return n


def param_count(mc: ModelConfig) -> int:
    """Parameters of the whole model from its config alone (no module built): what a size typo costs, known
    before anything is allocated. Equals num_params(build_model(mc)) (tested)."""
    h, hd, heads, kv, ffn = mc.hidden_size, mc.dim_per_head, mc.num_heads, mc.num_kv_heads, mc.ffn_hidden_size
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h
    attn += (heads * hd + 2 * kv * hd) if mc.qkv_has_bias else 0
    attn += 2 * hd if mc.use_qk_norm else 0
    layer = attn + 3 * h * ffn + 2 * h
    embed = mc.vocab_size * h * (1 if mc.tie_word_embeddings else 2)
    return embed + mc.num_layers * layer + h
