"""The training side of MoE load balancing: the global-batch routing pre-pass, the step's expert loads summed over
the ranks, the auxiliary-loss-free routing-bias update and the per-layer load metrics (models/moe/balance.py has
the losses and what each layer counts).

Pre-pass (`routing_prepass`, the hook's `before_forward_backward`; only when a layer has the global_batch loss):
one forward without gradients over each of the rank's micro-batches (`parts.eval_loss`, in training mode and the step's
autocast, so the routes are the real forwards'), every layer's tokens per expert summed over the loss mesh, before
the real forwards, which then use the step's global f. Cost: one extra forward per step (about a third of a
step's compute). Not under pipeline parallelism (models/moe/validate.py refuses it): the pipeline's forward-only
path needs a training step first.

Bias update (`balance_via_topk_bias`): after each optimizer step that ran, every router's `e_score_correction_bias`
moves by delta = rate x sign(mean load - load), then delta -= mean(delta) (torchtitan; DeepSeek-V3's rule moves
each bias by rate x sign alone: top-k, and the group choice, are blind to a shift common to all experts; centring
keeps the biases' mean at zero, so they stay on the scale of the scores). Loads are the tokens
per expert of the step's counted forwards (a recompute in backward does not count again), summed over the loss
mesh (data-parallel, and the ranks expert parallelism borrows; not tensor-parallel ranks, which see the same
tokens), so every rank computes the same delta and the replicas stay equal. The bias is a persistent buffer:
checkpoints carry it.

Metrics (`step_metrics`): `moe/imbalance/layerN` (max / mean tokens per expert of the step, all ranks), with
capacity `moe/dropped/layerN` (fraction of (token, choice) pairs dropped), and the summaries `moe/imbalance_max`
and `moe/dropped_mean`. Pipeline stages sum their layers' figures over "pp" so the metrics rank has every layer.
"""

from __future__ import annotations

import torch

from meshformer.models.moe import MoEBlock
from meshformer.models.moe.balance import recording_routes
from meshformer.train.hooks import StepBatch, TrainHook, register_hook


def moe_blocks(parts) -> list[MoEBlock]:
    """This rank's MoE layers."""
    return parts.modules_of(MoEBlock)


def routing_prepass(parts, env, batch: StepBatch) -> None:
    """Every global_batch layer's `stats.global_counts`: the step's tokens per expert over the loss mesh."""
    blocks = [b for b in moe_blocks(parts) if b.needs_global_counts]
    if not blocks:
        return
    for b in blocks:
        b.stats.prepass = None
    n_micro = batch.n_micro
    docs = batch.documents.chunk(n_micro) if batch.documents is not None else [None] * n_micro
    with recording_routes():
        for x, y, d in zip(batch.inputs.chunk(n_micro), batch.labels.chunk(n_micro), docs):
            parts.eval_loss(x, y) if d is None else parts.eval_loss(x, y, d)
    counts = env.reduce_sum(torch.stack([b.stats.prepass for b in blocks]).to(torch.float64), "loss")
    for b, c in zip(blocks, counts):
        b.stats.global_counts = c


class MoeBalanceHook(TrainHook):
    """Resets the layers' statistics per step, sums them over the ranks, moves the routing biases, reports."""

    def __init__(self, cfg, parts, env):
        self.parts, self.env, self.blocks = parts, env, moe_blocks(parts)
        self.num_layers = cfg.model.model_config.num_layers
        m = cfg.model.model_config.moe_config
        self.rate = m.topk_bias_update_rate if m.balance_via_topk_bias else 0.0
        self.capacity = m.capacity_factor is not None
        self.loads: torch.Tensor | None = None  # [blocks, experts] this step's global tokens per expert
        self.figures: torch.Tensor | None = None  # [layers, 2] imbalance, dropped fraction (0 for dense layers)

    @classmethod
    def for_run(cls, cfg, parts, env=None):
        """The hook of a run whose model has MoE layers (None otherwise); env defaults to parts.env."""
        return cls(cfg, parts, env or parts.env) if cfg.model.model_config.is_moe and moe_blocks(parts) else None

    def step_context(self, step):
        for b in self.blocks:
            b.stats.reset()
        return None

    def before_forward_backward(self, step, batch: StepBatch) -> None:
        routing_prepass(self.parts, self.env, batch)  # only where a layer has the global_batch loss

    def before_optimizer_step(self, step) -> None:
        """One reduction of every layer's counts, dropped and routed pairs over the loss mesh."""
        rows = []
        for b in self.blocks:
            st = b.stats
            counts = st.tokens_per_expert
            if counts is None:  # the layer did not run this step (it must, on every step: MoEBlock always routes)
                raise RuntimeError(f"MoE layer {b.layer_idx} counted no tokens this step")
            dropped = torch.as_tensor(st.dropped, dtype=torch.float64, device=counts.device).reshape(1)
            routed = torch.full((1,), st.routed, dtype=torch.float64, device=counts.device)
            rows.append(torch.cat([counts.to(torch.float64), dropped, routed]))
        stacked = self.env.reduce_sum(torch.stack(rows), "loss")
        self.loads = stacked[:, :-2]
        figures = torch.zeros(self.num_layers, 2, dtype=torch.float64, device=stacked.device)
        idx = torch.tensor([b.layer_idx for b in self.blocks], device=stacked.device)
        figures[idx, 0] = self.loads.max(dim=1).values / self.loads.mean(dim=1)
        figures[idx, 1] = stacked[:, -2] / stacked[:, -1]
        self.figures = self.env.all_reduce_sum_pp(figures)

    def after_optimizer_step(self, step) -> None:
        if not self.rate or self.loads is None:
            return
        for b, load in zip(self.blocks, self.loads):
            bias = b.gate.e_score_correction_bias
            if bias is None:
                continue
            delta = self.rate * torch.sign(load.mean() - load)
            delta = (delta - delta.mean()).to(torch.float32)
            local = bias.to_local() if hasattr(bias, "to_local") else bias
            local.add_(delta.to(local.device))

    def step_metrics(self, step) -> dict[str, float]:
        if self.figures is None:
            return {}
        fig = self.figures.tolist()
        layers = _moe_layers(self.figures)
        out = {f"moe/imbalance/layer{i}": fig[i][0] for i in layers}
        out["moe/imbalance_max"] = max(fig[i][0] for i in layers)
        if self.capacity:
            out |= {f"moe/dropped/layer{i}": fig[i][1] for i in layers}
            # not `moe/dropped`: a name that is also the folder of others breaks MLflow's file store (a file per path)
            out["moe/dropped_mean"] = sum(fig[i][1] for i in layers) / len(layers)
        return out


def _moe_layers(figures: torch.Tensor) -> list[int]:
    """Layers with a load figure (an MoE layer's imbalance is >= 1; a dense layer's row stays 0)."""
    return [i for i, v in enumerate(figures[:, 0].tolist()) if v > 0]


register_hook("moe_balance", MoeBalanceHook.for_run)
