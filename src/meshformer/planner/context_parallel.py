"""What context parallelism changes in a rank's memory (parallel/context_parallel.py), for `meshformer plan`.

A cp rank runs every layer on seq_length / cp tokens of each row, so its activations and logits are the planner's
at that length (`local_config`), plus what the all-gather form adds (`extra_bytes`):
- the gathered keys and values each attention layer keeps for backward: every rank's, 2 x micro_batch x seq x
  (kv_heads / tp) x head_dim elements in the compute dtype, of which the local (1/cp) part is already counted;
  a fully recomputed layer makes them again in its backward (one layer at a time: the recompute peak);
- latent attention (DeepSeek, `mc.uses_mla`) gathers each token's [latent, rotary key] instead, and every rank
  expands the whole row's keys and values itself: a layer keeps the gathered entries (kv_b_proj's input),
  micro_batch x seq x (kv_lora_rank + qk_rope_head_dim), and its checkpointed attention's inputs, the local queries
  (heads / tp x qk_head_dim) and the whole row's keys (heads / tp x (qk_nope_head_dim + qk_rope_head_dim)) and
  contiguous values (heads / tp x v_head_dim); the local plan counted the entries at the local length and what the
  plain attention kernel saves there, which is taken off, counted on fake tensors as the local plan counts it;
- while one layer's attention runs (forward, and again in backward: it is checkpointed), its float mask
  [rows, 1, seq / cp, seq] in the compute dtype (rows: micro_batch with packed documents, else 1): transient.
Measured against the trainer's step (bench/context_parallel.py, docs/benchmarks.md): within 2% at cp 2 and 4; the
DeepSeek-V3-shaped parity model's step (tests/test_context_parallel.py) within 0.1% at cp2, cp4 and tp2 x cp2.
"""

from __future__ import annotations

import dataclasses

from meshformer.config.schema import MeshformerConfig
from meshformer.parallel.dims import ParallelDims


def local_config(cfg: MeshformerConfig) -> MeshformerConfig:
    """The config with seq_length cut to one cp rank's tokens of a row (the config itself without cp)."""
    cp = cfg.parallel_config.context_parallel
    if cp == 1:
        return cfg
    mc = cfg.model.model_config
    local = dataclasses.replace(mc, seq_length=mc.seq_length // cp)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, model_config=local))


def extra_bytes(
    cfg: MeshformerConfig, dims: ParallelDims, micro_batch: int, layers: int, recomputed: int
) -> tuple[int, int]:
    """(bytes the all-gather attention adds to the saved activations of one micro-batch, to the transient peak of one
    layer) on a rank holding `layers` decoder layers, whose first `recomputed` are fully recomputed."""
    if dims.cp == 1:
        return 0, 0
    mc = cfg.model.model_config
    a = 2 if mc.compute_dtype != "float32" else 4
    seq, local = mc.seq_length, mc.seq_length // dims.cp
    rows = micro_batch if cfg.train_dataset.data_loader.packing else 1
    mask = rows * local * seq * a
    if mc.uses_mla:
        layer_kv, kernel = _latent_bytes(cfg, dims, micro_batch)
        mask += kernel
    else:
        layer_kv = 2 * micro_batch * seq * (mc.num_kv_heads // dims.tp) * mc.dim_per_head * a * (dims.cp - 1) // dims.cp
    return (layers - recomputed) * layer_kv, mask + (layer_kv if recomputed else 0)


def _latent_bytes(cfg: MeshformerConfig, dims: ParallelDims, micro_batch: int) -> tuple[int, int]:
    """(what one latent-attention layer keeps under cp beyond the local-length plan, what its checkpointed attention
    saves while backward makes it again). Kept: the gathered entries [latent, rotary key] of the whole row
    (kv_b_proj's input) and the checkpointed attention's inputs (the local queries, every rank's expanded keys and
    contiguous values), less what the plain attention kernel keeps at the local length, which the local plan
    counted. The kernels' own saved tensors are counted on fake tensors through models/attention.py, as the model
    runs them (on a CPU the values padded to the queries' width: the flash kernel, no probabilities kept)."""
    mc = cfg.model.model_config
    a = 2 if mc.compute_dtype != "float32" else 4
    b, seq, local, heads = micro_batch, mc.seq_length, mc.seq_length // dims.cp, mc.num_heads // dims.tp
    entries = b * (seq - local) * (mc.kv_lora_rank + mc.qk_rope_head_dim)
    kept = b * heads * (local * mc.qk_head_dim + seq * (mc.qk_head_dim + mc.v_head_dim))
    plain = _attention_saved_bytes(cfg, b, heads, local, local, cp_form=False)
    return (entries + kept) * a - plain, _attention_saved_bytes(cfg, b, heads, local, seq, cp_form=True)


def _attention_saved_bytes(cfg: MeshformerConfig, b: int, h: int, s: int, keys: int, cp_form: bool) -> int:
    """Bytes the SDPA of a latent-attention layer saves for backward, counted on fake tensors by storage as
    train/memory.py counts a step (and planner/counted_activations.py the local plan). The plain form
    (models/deepseek/mla.py `_expanded`): fresh q and k, values a view of kv_b_proj's output, causal; what it saves
    counts. cp's (parallel/context_parallel.py `masked_attention`): contiguous q, k, v and a float mask; its inputs
    (kept by the checkpoint, counted apart) do not."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef

    from meshformer.backends.torch_private import fake_tensor_mode
    from meshformer.dtypes import DTYPE
    from meshformer.models.attention import causal_attention, sdpa

    mc = cfg.model.model_config
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


def with_context_parallel(stage, cfg: MeshformerConfig, dims: ParallelDims, micro_batch: int):
    """A StageMemory planned on `local_config(cfg)` with the all-gather attention's bytes added (`extra_bytes`)."""
    if dims.cp == 1:
        return stage
    from meshformer.planner.memory import _recomputed_layers

    recomputed = _recomputed_layers(cfg, stage.stage, stage.layers)[0]
    kept, transient = extra_bytes(cfg, dims, micro_batch, stage.layers, recomputed)
    return dataclasses.replace(
        stage,
        activations_bytes=stage.activations_bytes + stage.in_flight * kept,  # every micro-batch in flight
        recompute_bytes=stage.recompute_bytes + transient,
    )
