"""Work a step does beyond one forward and one backward of the model: recomputed layers and the global-batch
balancing loss's routing pre-pass (planner/throughput.py for the step time, planner/experts.py for the all-to-all
calls)."""

from __future__ import annotations

from meshformer.config.schema import MeshformerConfig


def recompute_share(cfg: MeshformerConfig) -> float:
    """Share of decoder layers whose forward runs twice."""
    rc = cfg.recompute_config.recompute
    layers = cfg.model.model_config.num_layers
    if rc is True:
        return 1.0
    if isinstance(rc, list):
        return min(1.0, sum(rc) * cfg.parallel_config.pipeline_stage / max(1, layers) / max(1, len(rc)))
    return 0.0


def prepass_share(cfg: MeshformerConfig) -> float:
    """Extra work of the global-batch balancing loss: one forward without gradients per step (a third of a step's
    model FLOPs) that routes every micro-batch first (train/moe_balance.py `routing_prepass`)."""
    from meshformer.models.moe.validate import aux_losses

    mc = cfg.model.model_config
    return 1 / 3 if mc.is_moe and "global_batch" in aux_losses(mc) else 0.0
