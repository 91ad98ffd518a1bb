"""The planner's Mixture-of-Experts figures: parameters (total, active, routed experts per rank) and expert
parallelism's all-to-all (its volume per step and its buffers), from the config and the layout alone.

Parameters are counted on the family's meta-device modules (models/moe/params.py), so every MoE family is planned
the same way. A rank holds expert_num / ep experts of each of its MoE layers, FSDP-sharded over `efsdp` when the
run shards (planner/memory.py `expert_local_numel`); its states are in the stage's states like any parameter.

All-to-all (expert parallelism, parallel/expert_parallel.py): every MoE layer sends each routed row (T k rows of h
elements in the compute dtype, T = micro_batch x seq_length tokens) to the rank holding its expert and takes the
result back (dispatch + combine), and backward does both again for the gradients: 4 x T k h x a per layer and
micro-batch, of which a share (ep - 1) / ep leaves the rank (an even load). A fully recomputed layer dispatches
and combines once more in its backward (+2), and so does the global-batch balancing loss's routing pre-pass (+2).
The transfers sit on the critical path (a layer waits for its tokens), over NVLink while ep x tp fits in a node
and over the network beyond. Buffers: the rows sent and the rows received of one layer at a time, 2 x T k h x a,
alive during its dispatch (the received rows are then the experts' saved input, counted with the activations).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshformer.parallel.dims import ParallelDims
from meshformer.planner.extra_work import prepass_share, recompute_share


@dataclass(frozen=True)
class ExpertFigures:
    total_params: int
    active_params: int  # what one token passes through (the FLOPs rule counts these)
    routed_params: int  # every routed expert of every layer
    moe_layers: int
    experts_per_rank: int  # of one MoE layer, after ep
    routed_params_per_rank: int  # on one rank (of the stage with the most MoE layers), after ep and FSDP
    a2a_bytes: float  # per rank and optimizer step, sent (as much is received)
    a2a_buffer_bytes: int  # send + receive buffers of one layer's dispatch

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def expert_figures(cfg, dims: ParallelDims, micro_batch: int, n_micro: int) -> ExpertFigures | None:
    """None for a dense model."""
    from meshformer.models.moe.params import moe_params
    from meshformer.models.registry import family_of

    mc = cfg.model.model_config
    fam = family_of(mc)
    if not (fam.moe and mc.is_moe):
        return None
    m = mc.moe_config
    counts = moe_params(fam, mc)
    a = 4 if mc.compute_dtype == "float32" else 2
    rows = micro_batch * mc.seq_length * m.num_experts_chosen
    layers_per_rank = math.ceil(counts.moe_layers / dims.pp)
    calls = 4 + (2 if recompute_share(cfg) else 0) + (2 if prepass_share(cfg) else 0)
    a2a = calls * layers_per_rank * n_micro * rows * mc.hidden_size * a * (dims.ep - 1) / dims.ep
    per_layer = counts.routed // max(1, counts.moe_layers)
    local = math.ceil(m.expert_num / dims.ep)
    shards = dims.efsdp if dims.ep > 1 and dims.dp_shard > 1 else (dims.dp_shard if dims.ep == 1 else 1)
    routed_local = layers_per_rank * per_layer * local // m.expert_num // max(1, shards)
    buffers = 2 * rows * mc.hidden_size * a if dims.ep > 1 else 0
    return ExpertFigures(
        counts.total,
        counts.active(m.num_experts_chosen, m.expert_num),
        counts.routed,
        counts.moe_layers,
        local,
        routed_local,
        a2a,
        buffers,
    )
