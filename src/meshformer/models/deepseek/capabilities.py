"""What the rest of meshformer asks the DeepSeek family (models/registry.py ModelFamily) where latent attention
differs from grouped-query attention: its FLOPs, its KV cache, what context parallelism gathers and installs, and
what a cp rank keeps for backward (planner/context_parallel.py asks)."""

from __future__ import annotations

from meshformer.models.registry import AttentionCost


def attention_cost(mc) -> AttentionCost:
    """Scores over q/k heads qk_head_dim wide, the weighted sum over values v_head_dim wide."""
    L, heads, qk, v, s = mc.num_layers, mc.num_heads, mc.qk_head_dim, mc.v_head_dim, mc.seq_length
    return AttentionCost(
        6 * L * heads * (qk + v) * s, "6 x L x heads x (qk + v) x s", f"6 x {L} x {heads} x ({qk} + {v}) x {s}"
    )


def latent_width(mc, tp: int = 1) -> int:
    """Numbers latent attention caches, and context parallelism gathers, per token and layer: the compressed
    key/value and the rotary key, whole on every tp rank (mla.py)."""
    return mc.kv_lora_rank + mc.qk_rope_head_dim


def cp_saved_bytes(cfg, dims, micro_batch: int) -> tuple[int, int]:
    """(what one latent-attention layer keeps under cp beyond the local-length plan, what its checkpointed attention
    saves while backward makes it again). A cp rank gathers each token's [latent, rotary key] and expands the whole
    row's keys and values itself: it keeps the gathered entries (kv_b_proj's input) and the checkpointed attention's
    inputs (the local queries, every rank's expanded keys and contiguous values), less what the plain attention
    kernel keeps at the local length, which the local plan counted. The kernels' own saved tensors are counted on
    fake tensors through models/attention.py, as the model runs them (on a CPU the values padded to the queries'
    width: the flash kernel, no probabilities kept)."""
    mc = cfg.model.model_config
    a = 2 if mc.compute_dtype != "float32" else 4
    b, seq, local, heads = micro_batch, mc.seq_length, mc.seq_length // dims.cp, mc.num_heads // dims.tp
    entries = b * (seq - local) * (mc.kv_lora_rank + mc.qk_rope_head_dim)
    kept = b * heads * (local * mc.qk_head_dim + seq * (mc.qk_head_dim + mc.v_head_dim))
    plain = _attention_saved_bytes(mc, b, heads, local, local, cp_form=False)
    return (entries + kept) * a - plain, _attention_saved_bytes(mc, b, heads, local, seq, cp_form=True)


def _attention_saved_bytes(mc, b: int, h: int, s: int, keys: int, cp_form: bool) -> int:
    """Bytes the SDPA of a latent-attention layer saves for backward, counted on fake tensors by storage as
    train/memory.py counts a step (and planner/counted_activations.py the local plan). The plain form
    (mla.py `_expanded`): fresh q and k, values a view of kv_b_proj's output, causal; what it saves counts. cp's
    (parallel/context_parallel.py `masked_attention`): contiguous q, k, v and a float mask; its inputs (kept by the
    checkpoint, counted apart) do not."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef

    from meshformer.backends.torch_private import fake_tensor_mode
    from meshformer.dtypes import DTYPE
    from meshformer.models.attention import causal_attention, sdpa

    dtype, nope, qk, v_dim = DTYPE[mc.compute_dtype], mc.qk_nope_head_dim, mc.qk_head_dim, mc.v_head_dim
    storages: dict[StorageWeakRef, int] = {}

    def pack(t):
        storages[StorageWeakRef(t.untyped_storage())] = t.untyped_storage().nbytes()
        return t

    with fake_tensor_mode()():
        q = torch.empty(b, h, s, qk, dtype=dtype, requires_grad=True)
        k = torch.empty(b, h, keys, qk, dtype=dtype, requires_grad=True)
        kv = torch.empty(b, keys, h * (nope + v_dim), dtype=dtype, requires_grad=True)
        v = kv.view(b, keys, h, nope + v_dim).transpose(1, 2)[..., nope:]
        inputs = [q, k]
        if cp_form:
            v = torch.empty(b, h, keys, v_dim, dtype=dtype, requires_grad=True)
            mask = torch.zeros(1, 1, s, keys, dtype=dtype)
            inputs += [v, mask]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if cp_form:
                sdpa(q, k, v, mask, scale=1.0)
            else:
                causal_attention(q, k, v, None, scale=1.0)
        if cp_form:
            for t in inputs:
                storages.pop(StorageWeakRef(t.untyped_storage()), None)
    return sum(storages.values())
