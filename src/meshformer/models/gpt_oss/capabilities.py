"""What the GPT-OSS family answers for itself (models/registry.py ModelFamily): attention's FLOPs and the KV cache's
slots with a sliding window on some layers only (`layer_types`). Everything else is grouped-query attention's."""

from __future__ import annotations

from meshformer.models.registry import AttentionCost, dense_attention_cost


def window_keys(s: int, window: int | None) -> int:
    """Keys the `s` queries of a row attend in all: query i sees min(i + 1, window) of them."""
    w = s if window is None else min(window, s)
    return w * (w + 1) // 2 + (s - w) * w


def attention_cost(mc) -> AttentionCost:
    """The registry's not-halved count per layer (12 x heads x head_dim x s a token), each sliding layer's scaled by
    the share of the causal triangle's scores its window keeps, keys(W) / keys(s)."""
    dense = dense_attention_cost(mc)
    s, L = mc.seq_length, mc.num_layers
    causal = window_keys(s, None)
    keys = [window_keys(s, mc.window_of(i)) for i in range(L)]
    if all(k == causal for k in keys):
        return dense
    sliding = sum(k != causal for k in keys)
    w = min(mc.sliding_window, s)
    heads, hd = mc.num_heads, mc.dim_per_head
    per_layer = dense.flops_per_token // L
    return AttentionCost(
        sum(per_layer * k // causal for k in keys),
        "12 x heads x head_dim x s x (full layers + sliding layers x keys(W) / keys(s)), keys(W) = W(W+1)/2 + (s-W)W",
        f"12 x {heads} x {hd} x {s} x ({L - sliding} + {sliding} x {window_keys(s, w)} / {causal})",
    )


def kv_cache_tokens(mc, tokens: int) -> int:
    """A sliding layer's ring keeps at most its window's keys (models/kv_cache.py), a full layer every token."""
    return sum(tokens if mc.window_of(i) is None else min(mc.window_of(i), tokens) for i in range(mc.num_layers))
