"""What context parallelism changes in a rank's memory (parallel/context_parallel.py), for `meshformer plan`.

A cp rank runs every layer on seq_length / cp tokens of each row, so its activations and logits are the planner's
at that length (`local_config`), plus what the all-gather form adds (`extra_bytes`):
- the gathered keys and values each attention layer keeps for backward: every rank's, micro_batch x seq x the
  family's `cp_gather_width` (grouped-query attention: 2 x (kv_heads / tp) x head_dim) elements in the compute
  dtype, of which the local (1/cp) part is already counted; a fully recomputed layer makes them again in its
  backward (one layer at a time: the recompute peak);
- a family whose attention keeps something else under cp counts it itself (`cp_saved_bytes`: latent attention
  gathers each token's [latent, rotary key] and expands the whole row's keys and values on every rank,
  models/deepseek/capabilities.py);
- while one layer's attention runs (forward, and again in backward: it is checkpointed), its float mask
  [rows, 1, seq / cp, seq] in the compute dtype (rows: micro_batch with packed documents, else 1): transient.
Measured against the trainer's step (bench/context_parallel.py, docs/benchmarks.md): within 2% at cp 2 and 4; the
DeepSeek-V3-shaped parity model's step (tests/parity/test_context_parallel.py) within 0.1% at cp2, cp4 and tp2 x cp2.
"""

from __future__ import annotations

import dataclasses

from meshformer.config.schema import MeshformerConfig
from meshformer.models.registry import family_of
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
    family = family_of(mc)
    if family.cp_saved_bytes is not None:  # the family counts what its attention keeps under cp
        layer_kv, kernel = family.cp_saved_bytes(cfg, dims, micro_batch)
        mask += kernel
    else:  # the gathered K/V of every rank, the local part already counted
        layer_kv = micro_batch * seq * family.cp_gather_width(mc, dims.tp) * a * (dims.cp - 1) // dims.cp
    return (layers - recomputed) * layer_kv, mask + (layer_kv if recomputed else 0)


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
