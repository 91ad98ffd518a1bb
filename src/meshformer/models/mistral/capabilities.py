"""What the Mistral family answers for itself (models/registry.py ModelFamily): attention's FLOPs and the KV cache's
slots under the sliding window. Everything else is grouped-query attention's, as Llama's."""

from __future__ import annotations

from meshformer.models.registry import AttentionCost, dense_attention_cost


def window_keys(s: int, window: int | None) -> int:
    """Keys the `s` queries of a row attend in all: query i sees min(i + 1, window) of them."""
    w = s if window is None else min(window, s)
    return w * (w + 1) // 2 + (s - w) * w


def attention_cost(mc) -> AttentionCost:
    """The registry's not-halved convention (every query counted against all s keys: 12 x L x heads x head_dim x s)
    scaled by the share of the causal triangle's scores the window keeps: s x keys(W) / keys(s), keys(W) the keys a
    row's queries attend with the window (`window_keys`). A window as long as the row is the dense count; a short
    one tends to 2W keys a query, the not-halved count of W."""
    dense = dense_attention_cost(mc)
    s, window = mc.seq_length, mc.sliding_window
    if window is None or window >= s:
        return dense
    keys, causal = window_keys(s, window), window_keys(s, None)
    L, heads, hd = mc.num_layers, mc.num_heads, mc.dim_per_head
    return AttentionCost(
        dense.flops_per_token * keys // causal,
        "12 x L x heads x head_dim x s x keys(W) / keys(s), keys(W) = W(W+1)/2 + (s-W)W",
        f"12 x {L} x {heads} x {hd} x {s} x {keys} / {causal}",
    )


def kv_cache_tokens(mc, tokens: int) -> int:
    """Each layer's ring keeps at most the window's keys (models/kv_cache.py)."""
    window = mc.sliding_window
    return mc.num_layers * (tokens if window is None else min(window, tokens))
