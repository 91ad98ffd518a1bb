"""`PipelineParts`: the ModelParts of a pipeline rank, driven by a torch.distributed.pipelining schedule."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage

from meshformer.config.schema import MeshformerConfig
from meshformer.parallel.env import ParallelEnv
from meshformer.parallel.parts import LossFn, ModelParts, _local
from meshformer.parallel.pipeline import SCHEDULES, num_stages


class PipelineParts(ModelParts):
    """One or more stages on this rank. forward_backward returns the loss sum on the last stage, 0 elsewhere.

    Every stage receives the same (inputs, labels): the first stage consumes the tokens, the last the labels.
    Schedules are built on first use for a given micro-batch count (after the trainer materialized the
    weights), with scale_grads=False: the loss function already carries the global-token normalisation.
    """

    def __init__(self, parts: list[nn.Module], stage_ids: list[int], cfg: MeshformerConfig, env: ParallelEnv,
                 loss_fn: LossFn):
        super().__init__(parts, cfg, env, loss_fn)
        self.stage_ids = stage_ids
        self.n_stages = num_stages(cfg)
        self.has_first = 0 in stage_ids
        self.has_last = self.n_stages - 1 in stage_ids
        self._schedules: dict[int, object] = {}
        self._scale = 1.0
        self._recorded: list[torch.Tensor] = []

    def _pp_loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = self.loss_fn(out, target)
        self._recorded.append(_local(loss.detach()).float())
        return loss * self._scale

    def schedule(self, n_micro: int):
        if n_micro not in self._schedules:
            group = self.env.group("pp")
            stages = [PipelineStage(part, sid, self.n_stages, self.env.device, group=group)
                      for part, sid in zip(self.parts, self.stage_ids)]
            cls = SCHEDULES[self.cfg.parallel_config.pipeline_schedule]
            multi = issubclass(cls, torch.distributed.pipelining.schedules.PipelineScheduleMulti)
            self._schedules[n_micro] = cls(stages if multi else stages[0], n_microbatches=n_micro,
                                           loss_fn=self._pp_loss, scale_grads=False)
        return self._schedules[n_micro]

    def _run(self, inputs, labels, n_micro, train: bool) -> torch.Tensor:
        sched = self.schedule(n_micro)
        self._recorded = []
        args = (inputs,) if self.has_first else ()
        with self.loss_context(), self.autocast():
            if train:
                sched.step(*args, target=labels, return_outputs=False)
            else:
                sched.eval(*args, target=labels)
        total = torch.zeros((), device=self.env.device, dtype=torch.float32)
        if self.has_last:
            # The schedule may also call the loss while inferring shapes on its first step: the step's own
            # micro-batch losses are the last n_micro recorded.
            for v in self._recorded[-n_micro:]:
                total += v
        return total

    def forward_backward(self, inputs, labels, n_micro: int, loss_scale: float) -> torch.Tensor:
        self._scale = loss_scale
        return self._run(inputs, labels, n_micro, train=True)

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed token loss on the last stage (0 elsewhere); one micro-batch per pipeline stage."""
        self._scale = 1.0
        n = max(1, min(self.cfg.parallel_config.micro_batch_num, inputs.shape[0]))
        return self._run(inputs, labels, n, train=False)
