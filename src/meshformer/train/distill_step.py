"""The distillation step's loss: what the student's parts call per micro-batch in place of the token cross-entropy,
with the teacher's logits (train/distill_teacher.py, a FrozenModel) for the same micro-batch, and the step's metrics.

Targets: the parts hand the loss (logits, targets), and what the teacher needs travels with the micro-batch's rows
through accumulation and pipeline schedules (which split targets by rows). Without pipeline parallelism targets
are [rows, seq, 2 or 3]: the labels, the input ids and (packed rows) the document index, all exact in float64; the
loss runs the teacher on them, so one micro-batch's teacher logits exist at a time. Under pipeline parallelism the
teacher's stages run before the student's schedule (`prepare`), and targets on the last stage are
[rows, seq, 1 + vocab]: the labels and the teacher's logits (its vocabulary shard under tensor parallelism, rebuilt
as a DTensor of the student's logits' layout); the other stages get the labels alone (they never call the loss).
Under tensor parallelism both logits are vocab-sharded and the divergence runs on the shards (train/distill_loss.py).

Normalisation (as SFT's, train/step.py): a micro-batch's loss is alpha x the summed divergence + (1 - alpha) x
the summed cross-entropy over its counted tokens (labels != ignore); the step divides by the global count of
counted tokens, so every layout and accumulation split gives TRL's `sum / num_items_in_batch` over the global
batch. Called with plain labels (validation: `evaluate`), it returns the summed cross-entropy, the SFT loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from meshformer.config.schema import MeshformerConfig
from meshformer.dtypes import DTYPE
from meshformer.parallel import ParallelEnv
from meshformer.train.distill_loss import distill_loss_sum

# metrics.jsonl's names: the mean divergence and the mean hard-label cross-entropy over the step's counted tokens
METRICS = ("distill/divergence", "distill/ce")


def trains_distillation(cfg: MeshformerConfig) -> bool:
    return cfg.distill_config.enabled


def _full(x: torch.Tensor) -> torch.Tensor:
    return x.full_tensor() if isinstance(x, DTensor) else x


class DistillObjective:
    """The loss function the student's parts call, (logits, targets) -> this micro-batch's summed loss."""

    def __init__(self, cfg: MeshformerConfig, env: ParallelEnv):
        mc = cfg.model.model_config
        self.dc, self.env = cfg.distill_config, env
        self.ignore, self.dtype = mc.ignore_token_id, DTYPE[mc.softmax_compute_dtype]
        self.teacher = None  # a FrozenModel (train/distill_teacher.py build_teacher), set by whoever built it
        self.placements = None  # the teacher's logits' DTensor layout (tensor parallelism), None: plain tensors
        self.records: list[torch.Tensor] = []

    def prepare(
        self, inputs: torch.Tensor, labels: torch.Tensor, documents: torch.Tensor | None, n_micro: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(targets, the step's global count of counted tokens) for this rank's rows; under pipeline parallelism
        the teacher's forward runs here, for all micro-batches, before the student's."""
        n_tok = self.env.reduce_sum((labels != self.ignore).sum().to(torch.float64), "loss")
        self.records = []
        if not self.teacher.pipelined:  # the loss runs it per micro-batch; its weights are freed after the last
            self.teacher.expect_micro_batches(n_micro)
            columns = [labels, inputs] + ([documents] if documents is not None else [])
            return torch.stack(columns, dim=-1).to(torch.float64), n_tok
        targets = []  # filled by the teacher's pass on the last stage, as its logits come

        def keep(logits: torch.Tensor, i: int) -> None:
            self._keep(targets, labels, logits, i, n_micro)

        self.teacher.map_logits(inputs, None, n_micro, keep)  # packed rows are refused under pipelines
        if not targets:  # a pipeline stage before the last: the loss never runs here
            return labels.unsqueeze(-1).float(), n_tok
        return targets[0], n_tok

    def _keep(self, targets: list, labels: torch.Tensor, logits: torch.Tensor, i: int, n_micro: int) -> None:
        """Write micro-batch i's teacher logits into the step's targets [rows, seq, 1 + vocab] (labels first),
        made at the first: the logits of all micro-batches are held once, in float32, without a copy to join."""
        if isinstance(logits, DTensor):
            self.placements = logits.placements
            logits = logits.to_local()
        if not targets:
            dtype = torch.promote_types(logits.dtype, torch.float32)
            targets.append(labels.new_empty((*labels.shape, 1 + logits.shape[-1]), dtype=dtype))
            targets[0][..., 0] = labels
        targets[0].chunk(n_micro)[i][..., 1:].copy_(logits)

    def _teacher_logits(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The teacher's logits of this micro-batch, laid out as the student's `logits`."""
        if not self.teacher.pipelined:
            documents = targets[..., 2].long() if targets.shape[-1] > 2 else None
            return self.teacher.micro_batch_logits(targets[..., 1].long(), documents)
        teacher = targets[..., 1:].contiguous()
        if not isinstance(logits, DTensor):
            return teacher
        if tuple(logits.placements) != tuple(self.placements or ()):
            raise RuntimeError(
                f"the teacher's logits are laid out as {self.placements}, the student's as {logits.placements}: "
                "both models' heads must use the same tensor-parallel style"
            )
        return DTensor.from_local(
            teacher, logits.device_mesh, logits.placements, run_check=False, shape=logits.shape,
            stride=logits.stride(),
        )  # fmt: skip

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if targets.dim() == 2:  # plain labels (validation): the summed hard-label cross-entropy
            return self._cross_entropy(logits, targets).float()
        labels = targets[..., 0].long()
        teacher = self._teacher_logits(logits, targets)
        loss, m = distill_loss_sum(logits, teacher, labels, self.dc, self.ignore)
        del teacher
        ce = m["ce_sum"]
        if self.dc.alpha == 1:  # not in the loss: computed for the metric only
            with torch.no_grad():
                ce = self._cross_entropy(logits, labels)
        record = [m["divergence_sum"], ce, m["tokens"]]
        self.records.append(torch.stack([t.detach().to(torch.float64) for t in record]))
        return loss

    def _cross_entropy(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return _full(
            F.cross_entropy(
                logits.flatten(0, 1).to(self.dtype), labels.flatten(), ignore_index=self.ignore, reduction="sum"
            )
        )

    def step_metrics(self, n_micro: int) -> dict[str, float]:
        """The step's mean divergence and cross-entropy over its counted tokens (a pipeline schedule may call the
        loss once more to infer shapes: the step's own calls are the last n_micro)."""
        env, records = self.env, self.records[-n_micro:]
        local = torch.stack(records).sum(0) if records else torch.zeros(3, dtype=torch.float64)
        divergence, ce, tokens = env.all_reduce_sum_pp(env.reduce_sum(local.to(env.device), "loss")).tolist()
        return {METRICS[0]: divergence / max(tokens, 1.0), METRICS[1]: ce / max(tokens, 1.0)}
