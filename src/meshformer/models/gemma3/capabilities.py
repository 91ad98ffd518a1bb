"""What the Gemma 3 family answers for itself (models/registry.py ModelFamily): attention's FLOPs and the KV cache's
slots, each layer with its own window (sliding layers `sliding_window`, global layers every key)."""

from __future__ import annotations

from meshformer.models.mistral.capabilities import window_keys
from meshformer.models.registry import AttentionCost, dense_attention_cost


def attention_cost(mc) -> AttentionCost:
    """The registry's not-halved convention (12 x heads x head_dim x s per layer, every query against all s keys)
    summed over the layers, each scaled by the share of the causal triangle's scores its window keeps:
    keys(W_l) / keys(s), keys(W) = W(W+1)/2 + (s-W)W the keys a row's queries attend (a global layer: W = s)."""
    dense = dense_attention_cost(mc)
    s, L = mc.seq_length, mc.num_layers
    keys = [window_keys(s, mc.window_of(i)) for i in range(L)]
    causal = window_keys(s, None)
    if all(k == causal for k in keys):
        return dense
    heads, hd = mc.num_heads, mc.dim_per_head
    return AttentionCost(
        dense.flops_per_token // L * sum(keys) // causal,
        "12 x heads x head_dim x s x sum over layers of keys(W_l) / keys(s), keys(W) = W(W+1)/2 + (s-W)W",
        f"12 x {heads} x {hd} x {s} x {sum(keys)} / {causal}",
    )


def kv_cache_tokens(mc, tokens: int) -> int:
    """A sliding layer's ring keeps at most its window's keys, a global layer all `tokens` (models/kv_cache.py)."""
    windows = [mc.window_of(i) for i in range(mc.num_layers)]
    return sum(tokens if w is None else min(w, tokens) for w in windows)
