"""What the trainer drives: the model part(s) this rank holds and how to run a step over them.

`ModelParts` is the contract between the trainer and the parallel layer. The trainer hands it a rank's
micro-batches and a loss scale; it runs forward and backward (accumulating, or through a pipeline schedule)
and returns the summed (unscaled) token loss. The trainer never looks inside. Auxiliary losses a module reports
(models/aux_loss.py): the step collects them around forward_backward, and each micro-batch's real forward runs
under `counting_aux_losses` (so a recompute in backward does not count again); their gradient rides on the
activations' backward, so it flows under accumulation and on every pipeline stage alike.

`parallel/parallelize.py` builds it; `train/step.py` drives it.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from meshformer.backends.torch_private import foreach_mul_
from meshformer.config.schema import MeshformerConfig
from meshformer.dtypes import DTYPE
from meshformer.models.aux_loss import counting_aux_losses
from meshformer.parallel.data_parallel import reshard, set_grad_sync
from meshformer.parallel.env import ParallelEnv

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, labels) -> summed token loss
MicroContext = Callable[[int], contextlib.AbstractContextManager]  # micro-batch index -> what its fwd/bwd runs in


def _local(t: torch.Tensor) -> torch.Tensor:
    """A loss value as a plain tensor (under loss parallel it is a Replicate DTensor)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _call(model: nn.Module, x: torch.Tensor, documents: torch.Tensor | None) -> torch.Tensor:
    return model(x) if documents is None else model(x, documents=documents)


class ModelParts:
    """A rank's model pieces. This base class is the non-pipelined case: one part, micro-batches accumulated."""

    def __init__(self, parts: list[nn.Module], cfg: MeshformerConfig, env: ParallelEnv, loss_fn: LossFn):
        self.parts, self.cfg, self.env, self.loss_fn = parts, cfg, env, loss_fn
        # What parallelize decided, for the run's log: whether the layers and the loss were compiled and why, and
        # how context parallelism laid out the tokens (None: no context parallelism)
        self.compile_note = ""
        self.fp8_note = ""  # fp8_config: the linears in FP8 and those kept in bf16 (parallel/float8.py)
        self.cp_note: str | None = None
        self.aux_loss_names: list[str] | None = None  # the auxiliary losses all ranks reduce (train/step.py)
        self.aux_loss_normalized: set[str] = set()  # ... those already normalised by the model (only summed)
        self._modules_of: dict[type, list[nn.Module]] = {}  # modules_of's answers
        mc = cfg.model.model_config
        self.autocast_dtype = DTYPE[mc.compute_dtype] if mc.compute_dtype != mc.param_init_type else None

    def parameters(self):
        for p in self.parts:
            yield from p.parameters()

    def modules_of(self, cls: type) -> list[nn.Module]:
        """This rank's modules of class `cls` (a subclass's too), in order; looked up once per class."""
        if cls not in self._modules_of:
            self._modules_of[cls] = [m for part in self.parts for m in part.modules() if isinstance(m, cls)]
        return self._modules_of[cls]

    def named_parameters(self):
        for p in self.parts:
            yield from p.named_parameters()

    def train(self, mode: bool = True) -> None:
        for p in self.parts:
            p.train(mode)

    def reshard(self) -> None:
        """Free the FSDP-gathered weights after a forward that no backward follows (parallel/data_parallel.py)."""
        reshard(self.parts)

    def autocast(self):
        if self.autocast_dtype is None:
            return torch.autocast(self.env.device.type, enabled=False)
        return torch.autocast(self.env.device.type, dtype=self.autocast_dtype)

    def loss_context(self):
        """Under tensor parallelism the logits stay vocab-sharded and cross-entropy runs on the shards."""
        if self.env.tp_size > 1:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def forward_backward(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        n_micro: int,
        loss_scale: float | torch.Tensor,
        documents: torch.Tensor | None = None,
        micro_context: MicroContext | None = None,
    ) -> torch.Tensor:
        """inputs/labels: [n_micro * micro_batch, seq]. Backward of sum_loss * loss_scale per micro-batch.
        documents: [n_micro * micro_batch, seq] document index per position of packed rows (None: unpacked).
        micro_context: micro-batch i's forward and backward run in micro_context(i) (train/hooks.py).

        Returns the detached summed token loss over all micro-batches (before scaling).
        """
        model = self.parts[0]
        total = torch.zeros((), device=self.env.device, dtype=torch.float32)
        docs = documents.chunk(n_micro) if documents is not None else [None] * n_micro
        chunks = list(zip(inputs.chunk(n_micro), labels.chunk(n_micro), docs))
        with self.loss_context():
            for i, (x, y, d) in enumerate(chunks):
                set_grad_sync(self.parts, i == len(chunks) - 1)  # reduce gradients once, after the last
                with micro_context(i) if micro_context is not None else contextlib.nullcontext():
                    with self.autocast(), counting_aux_losses():
                        loss = self.loss_fn(_call(model, x, d), y)
                    (loss * loss_scale).backward()
                total += _local(loss.detach()).float()
        return total

    @torch.no_grad()
    def eval_loss(
        self, inputs: torch.Tensor, labels: torch.Tensor, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Summed token loss of one batch, no gradients (validation)."""
        with self.loss_context(), self.autocast():
            return _local(self.loss_fn(_call(self.parts[0], inputs, documents), labels)).float()

    def persistent_buffers(self) -> list[torch.Tensor]:
        """Activation-sized buffers that live through every step (none without pipeline parallelism)."""
        return []

    def grad_norm(self, groups: dict | None = None) -> torch.Tensor:
        """Global L2 norm of all gradients over every rank's pieces (tp/dp via DTensor, pp via all-reduce)."""
        sq = torch.zeros((), device=self.env.device, dtype=torch.float32)
        # torch's norm, not BLAS's dot (a third the time on a CPU): a dot's sum depends on the thread count, and a
        # run resumed with other threads must repeat the same numbers (docs/benchmarks.md)
        for grads in (groups if groups is not None else _grad_groups(self.parameters())).values():
            n = torch.nn.utils.get_total_norm(grads, 2.0, False, True)
            sq += _local(n).float() ** 2
        return self.env.all_reduce_sum_pp(sq).sqrt()

    def scale_grads_(self, factor: float) -> None:
        """Multiply every gradient in place (undoing a loss scale before the norm and the update)."""
        for grads in _grad_groups(self.parameters()).values():
            foreach_mul_(grads, factor)

    def clip_grad_norm_(self, max_norm: float | None) -> torch.Tensor:
        """Global L2 norm of all gradients; clips them in place when max_norm is given (torch's formula). Nothing
        is read back: the coefficient stays a device scalar (torch.nn.utils.clip_grads_with_norm_ does the same),
        so the host queues the optimizer step without waiting for backward to finish."""
        groups = _grad_groups(self.parameters())
        total = self.grad_norm(groups)
        if max_norm is not None:
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for grads in groups.values():
                local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]  # shards: views, in place
                foreach_mul_(local, coef.to(local[0].device))
        return total


def _grad_groups(params) -> dict:
    """Gradients grouped by DTensor layout (mesh, placements); plain tensors under key None.

    One group's norm is one reduction over its mesh; mixing layouts in one foreach call is not allowed.
    Every rank of a mesh holds the same parameter structure, so groups (and collectives) line up.
    """
    groups: dict = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    return groups
