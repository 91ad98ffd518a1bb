"""`PipelineParts`: the ModelParts of a pipeline rank, driven by a torch.distributed.pipelining schedule."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage

from meshformer.backends.torch_private import pipeline_batch_p2p, pipeline_schedule_stages
from meshformer.config.schema import MeshformerConfig
from meshformer.models.aux_loss import counting_aux_losses
from meshformer.parallel.env import ParallelEnv
from meshformer.parallel.parts import LossFn, ModelParts, _local
from meshformer.parallel.pipeline import SCHEDULES, num_stages


class _Stage(PipelineStage):
    """A stage whose schedule-driven forwards count the auxiliary losses they report (models/aux_loss.py): the
    schedule's shape inference on the first step, and a recompute in backward, run the module outside this."""

    def forward_one_chunk(self, *args, **kwargs):
        with counting_aux_losses():
            return super().forward_one_chunk(*args, **kwargs)


class PipelineParts(ModelParts):
    """One or more stages on this rank. forward_backward returns the loss sum on the last stage, 0 elsewhere.

    Every stage receives the same (inputs, labels): the first stage consumes the tokens, the last the labels.
    Schedules are built on first use for a given micro-batch count (after the trainer materialized the
    weights), with scale_grads=False: the loss function already carries the global-token normalisation.
    """

    def __init__(
        self, parts: list[nn.Module], stage_ids: list[int], cfg: MeshformerConfig, env: ParallelEnv, loss_fn: LossFn
    ):
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
            stages = [
                _Stage(part, sid, self.n_stages, self.env.device, group=group)
                for part, sid in zip(self.parts, self.stage_ids)
            ]
            cls = SCHEDULES[self.cfg.parallel_config.pipeline_schedule]
            multi = issubclass(cls, torch.distributed.pipelining.schedules.PipelineScheduleMulti)
            self._schedules[n_micro] = cls(
                stages if multi else stages[0], n_microbatches=n_micro, loss_fn=self._pp_loss, scale_grads=False
            )
        return self._schedules[n_micro]

    def forward_backward(
        self, inputs, labels, n_micro: int, loss_scale: float | torch.Tensor, documents=None, micro_context=None
    ) -> torch.Tensor:
        if documents is not None:  # config validation refuses packing with pipeline_stage > 1
            raise ValueError("packed documents are not supported with pipeline parallelism")
        if micro_context is not None:  # the schedule interleaves micro-batches inside one call (train/hooks.py)
            raise ValueError(
                "a training hook's micro_batch_context cannot run under pipeline parallelism: the schedule "
                "interleaves its micro-batches; wrap the whole step with step_context instead"
            )
        sched = self.schedule(n_micro)
        self._scale, self._recorded = loss_scale, []
        self._last = (n_micro, inputs.shape[0] // n_micro)
        args = (inputs,) if self.has_first else ()
        with self.loss_context(), self.autocast():
            sched.step(*args, target=labels, return_outputs=False)
        total = torch.zeros((), device=self.env.device, dtype=torch.float32)
        if self.has_last:
            # The schedule may also call the loss while inferring shapes on its first step: the step's own
            # micro-batch losses are the last n_micro recorded.
            for v in self._recorded[-n_micro:]:
                total += v
        return total

    def persistent_buffers(self) -> list[torch.Tensor]:
        """The buffers each later stage receives its micro-batches' inputs into (one per micro-batch, made on the
        first step and kept): memory accounting counts them whether or not a saved tensor is a view of them."""
        out = []
        for sched in self._schedules.values():
            for stage in pipeline_schedule_stages(sched):
                for infos in stage.args_recv_info.values():
                    out += [r.buffer for r in infos if isinstance(getattr(r, "buffer", None), torch.Tensor)]
        return out

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed token loss on the last stage (0 elsewhere), forward only.

        The training schedules cannot run forward-only in every case (the zero-bubble ones always issue their
        split backward actions), so evaluation walks the stages in global order with the stages' own P2P ops:
        each rank runs the stages it holds as their inputs arrive (GPipe order, no backward). The batch is cut
        into chunks of the training micro-batch size, the shape the stages' receive buffers were built for.
        """
        sorted_batch_p2p, wait_batch_p2p = pipeline_batch_p2p()
        if getattr(self, "_last", None) is None:
            raise RuntimeError("pipeline eval_loss needs one training step first (it reuses the schedule's stages)")
        n_micro, rows = self._last
        sched = self._schedules[n_micro]
        stages = {st.stage_index: st for st in pipeline_schedule_stages(sched)}
        if inputs.shape[0] % rows:
            raise ValueError(
                f"pipeline eval batch of {inputs.shape[0]} rows is not a multiple of the "
                f"training micro-batch ({rows} rows)"
            )
        total = torch.zeros((), device=self.env.device, dtype=torch.float32)
        with self.loss_context(), self.autocast():
            for x, y in zip(inputs.split(rows), labels.split(rows)):
                sends = []
                for s in range(self.n_stages):
                    st = stages.get(s)
                    if st is None:
                        continue
                    if not st.is_first and s - 1 not in stages:  # a neighbour on this rank handed it over
                        for w in sorted_batch_p2p(st.get_fwd_recv_ops(0), desc="fwd_recv").values():
                            wait_batch_p2p(w)
                    out = st.forward_one_chunk(0, (x,) if st.is_first else (), {})
                    if s + 1 in stages:  # V schedules: the next stage lives on this rank too
                        stages[s + 1].set_local_fwd_input(out, 0)
                    elif not st.is_last:
                        sends.extend(sorted_batch_p2p(st.get_fwd_send_ops(0), desc="fwd_send").values())
                    if st.is_last:
                        total += _local(self.loss_fn(out, y)).float()
                for w in sends:
                    wait_batch_p2p(w)
                for st in stages.values():
                    st.clear_runtime_states()
        return total
