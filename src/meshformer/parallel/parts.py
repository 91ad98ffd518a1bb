"""What the trainer drives: the model part(s) this rank holds and how to run a step over them.

`ModelParts` is the contract between the trainer and the parallel layer. The trainer hands it a rank's
micro-batches and a loss scale; it runs forward and backward (accumulating, or through a pipeline schedule)
and returns the summed (unscaled) token loss. The trainer never looks inside.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from meshformer.config.schema import MeshformerConfig
from meshformer.models.llama import DTYPE
from meshformer.parallel.env import ParallelEnv
from meshformer.parallel.recompute import apply_recompute

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, labels) -> summed token loss


class ModelParts:
    """A rank's model pieces. This base class is the non-pipelined case: one part, micro-batches accumulated."""

    def __init__(self, parts: list[nn.Module], cfg: MeshformerConfig, env: ParallelEnv, loss_fn: LossFn):
        self.parts, self.cfg, self.env, self.loss_fn = parts, cfg, env, loss_fn
        mc = cfg.model.model_config
        self.autocast_dtype = DTYPE[mc.compute_dtype] if mc.compute_dtype != mc.param_init_type else None

    def parameters(self):
        for p in self.parts:
            yield from p.parameters()

    def named_parameters(self):
        for p in self.parts:
            yield from p.named_parameters()

    def train(self, mode: bool = True) -> None:
        for p in self.parts:
            p.train(mode)

    def autocast(self):
        if self.autocast_dtype is None:
            return torch.autocast(self.env.device.type, enabled=False)
        return torch.autocast(self.env.device.type, dtype=self.autocast_dtype)

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, n_micro: int, loss_scale: float) -> torch.Tensor:
        """inputs/labels: [n_micro * micro_batch, seq]. Backward of sum_loss * loss_scale per micro-batch.

        Returns the detached summed token loss over all micro-batches (before scaling).
        """
        model = self.parts[0]
        total = torch.zeros((), device=self.env.device, dtype=torch.float32)
        for x, y in zip(inputs.chunk(n_micro), labels.chunk(n_micro)):
            with self.autocast():
                loss = self.loss_fn(model(x), y)
            (loss * loss_scale).backward()
            total += loss.detach().float()
        return total

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed token loss of one batch, no gradients (validation)."""
        with self.autocast():
            return self.loss_fn(self.parts[0](inputs), labels).float()

    def clip_grad_norm_(self, max_norm: float | None) -> torch.Tensor:
        """Global L2 norm of all gradients; clips them in place when max_norm is given."""
        params = [p for p in self.parameters() if p.grad is not None]
        if max_norm is None:
            return torch.nn.utils.get_total_norm([p.grad for p in params])
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)


def parallelize(model: nn.Module, cfg: MeshformerConfig, env: ParallelEnv, loss_fn: LossFn) -> ModelParts:
    """Apply the configured parallelism to a meta-device model; returns the parts this rank holds (still meta)."""
    if env.world_size > 1:
        raise NotImplementedError("multi-process runs arrive with the parallelism issue")
    apply_recompute(model, cfg.recompute_config.recompute, stage_index=0)
    return ModelParts([model], cfg, env, loss_fn)
