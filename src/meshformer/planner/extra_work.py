"""Work a step does beyond one forward and one backward of the model: recomputed layers and the global-batch
balancing loss's routing pre-pass (planner/throughput.py for the step time, planner/experts.py for the all-to-all
calls)."""

from __future__ import annotations

from meshformer.config.schema import MeshformerConfig


def recompute_share(cfg: MeshformerConfig) -> float:
    """Share of decoder layers whose forward runs twice."""
    return _layer_share(cfg, cfg.recompute_config.recompute)


def _layer_share(cfg: MeshformerConfig, setting) -> float:
    """Share of decoder layers a recompute setting covers (true, per-stage counts, MindSpore's select dict)."""
    layers = cfg.model.model_config.num_layers
    if isinstance(setting, dict):
        return max((_layer_share(cfg, v) for v in setting.values()), default=0.0)
    if setting is True:
        return 1.0
    if isinstance(setting, list):
        return min(1.0, sum(setting) * cfg.parallel_config.pipeline_stage / max(1, layers) / max(1, len(setting)))
    return 0.0


def selective_recompute_flops_per_token(cfg: MeshformerConfig) -> float:
    """Forward FLOPs per token that selective recompute runs again in backward: the linears' matmuls whose
    outputs select_recompute_policy does not keep (none under `matmuls`), in a decoder layer's order (q, k, v, o,
    gate, up, down), over the selectively (not fully) recomputed layers. The element-wise work it recomputes is
    the step efficiency's (planner/accelerators.py)."""
    from meshformer.models.activations import kept_matmul

    rc, mc = cfg.recompute_config, cfg.model.model_config
    share = max(0.0, _layer_share(cfg, rc.select_recompute) - recompute_share(cfg))
    h, f = mc.hidden_size, mc.ffn_hidden_size
    q, kv = mc.num_heads * mc.dim_per_head, mc.num_kv_heads * mc.dim_per_head
    linears = [(h, q), (h, kv), (h, kv), (q, h), (h, f), (h, f), (f, h)]
    dropped = sum(i * o for n, (i, o) in enumerate(linears) if not kept_matmul(rc.select_recompute_policy, n))
    return 2 * dropped * mc.num_layers * share


def prepass_share(cfg: MeshformerConfig) -> float:
    """Extra work of the global-batch balancing loss: one forward without gradients per step (a third of a step's
    model FLOPs) that routes every micro-batch first (train/moe_balance.py `routing_prepass`)."""
    from meshformer.models.moe.validate import aux_losses

    mc = cfg.model.model_config
    return 1 / 3 if mc.is_moe and "global_batch" in aux_losses(mc) else 0.0
