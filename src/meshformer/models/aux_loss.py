"""Auxiliary losses a module reports from its forward (an MoE router's load-balancing loss, a z-loss).

Contract. In its forward a module calls

    x = report_aux_loss("load_balance", value, x)

and goes on with the returned `x` (the same tensor values). `value` is a scalar SUM over this micro-batch's
tokens, like the main loss's sum (e.g. coef x the sum over tokens of a per-token penalty), never a mean. The
training step (train/step.py) treats it exactly as it treats the main loss: the gradient it receives is the
step's loss scale (gradient-averaging size / global counted tokens, x the fp16 loss scale), and the figure logged
as `aux_loss/<name>` in metrics.jsonl is its sum over every micro-batch, data-parallel rank and pipeline stage
divided by the global token count. So both are the same for every layout and accumulation split, and the
objective trained is the main loss plus every aux loss (metrics.jsonl's `loss` stays the main loss, comparable
with `eval_loss`). A module reports the same names on every step; a name reported several times in a step (one
per layer) is summed.

How. The value cannot join the main loss: under pipeline parallelism that exists on the last stage only. An
autograd function returns `x` unchanged and, in backward, gives `value` the step's loss scale as its gradient
(DeepSeek-MoE's AddAuxiliaryLoss, torchtitan's MoE), so the aux gradient flows on whatever stage the module runs,
as soon as backward reaches `x`. Some forwards run more than once per micro-batch: a recomputed layer's again in
backward, and a pipeline stage's once more on its first step, when the schedule infers the shapes it sends (and
their gradients, with a backward of its own). So only the value of a forward that runs under
`counting_aux_losses` (what ModelParts wraps each micro-batch's real forward in) is recorded, once.

Already-normalised values. A balancing loss is a mean over its own denominator (the step's routed tokens, its
sequences, its micro-batches), not over counted label tokens (which leave out masked prompt tokens). Such a
module reports `report_aux_loss(name, value, x, normalized=True)` with `value` = its micro-batch's share of the
global figure (e.g. the sum over this micro-batch's tokens of a penalty / the step's global routed tokens, read
from `step_totals()`); its gradient is then the gradient-averaging size x the fp16 loss scale (not / label
tokens) and the logged figure is its plain sum over micro-batches, data-parallel ranks and stages. A name is
reported one way or the other, never both.

Not covered yet: sequence parallelism, where a layer sees only its tensor-parallel rank's slice of the sequence
(the logged figure would sum one slice per data-parallel rank, not the whole sequence).

Outside a training step (evaluation, generation, a forward of one's own) nothing collects: `x` comes back as it
is and `value` is dropped. Plain torch: the step opens the collection (`collect_aux_losses`) around
forward/backward; the reductions over ranks are the step's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepTotals:
    """What the whole step (every micro-batch, data-parallel rank) holds, known before its first forward."""

    tokens: float  # token positions routed through each layer (padding included)
    sequences: float  # rows
    micro_batches: float  # forward passes
    # Context parallelism: each rank holds 1/row_parts of every row's tokens; `sum_over_row` sums a per-row
    # statistic over the ranks holding the rest of the same rows (a collective; identity without cp)
    row_parts: int = 1
    sum_over_row: Callable[[torch.Tensor], torch.Tensor] | None = None


class AuxLossCollector:
    """One step's reported values by name (summed, detached), and the loss scales their gradients get: `scale`
    for sums over tokens (the main loss's), `unit_scale` for already-normalised values."""

    def __init__(self, scale: torch.Tensor | float, unit_scale: float = 1.0, totals: StepTotals | None = None):
        self.scale, self.unit_scale, self.totals = scale, unit_scale, totals
        self.sums: dict[str, torch.Tensor] = {}
        self.normalized: set[str] = set()  # names whose values are already normalised (logged as summed)
        self.counting = False  # inside a micro-batch's real forward (counting_aux_losses)

    def add(self, name: str, value: torch.Tensor, normalized: bool = False) -> None:
        value = value.detach().float()
        self.sums[name] = self.sums[name] + value if name in self.sums else value
        if normalized:
            self.normalized.add(name)


_ACTIVE: list[AuxLossCollector] = []  # the step's collector while its forward/backward runs


@contextlib.contextmanager
def collect_aux_losses(
    scale: torch.Tensor | float, unit_scale: float = 1.0, totals: StepTotals | None = None
) -> Iterator[AuxLossCollector]:
    """Collect what modules report while active; their values' gradients are `scale` (the main loss's), or
    `unit_scale` for normalised ones; `totals` is what `step_totals()` answers meanwhile."""
    collector = AuxLossCollector(scale, unit_scale, totals)
    _ACTIVE.append(collector)
    try:
        yield collector
    finally:
        _ACTIVE.remove(collector)


@contextlib.contextmanager
def counting_aux_losses() -> Iterator[None]:
    """The forward run inside is one of the step's real ones: what it reports is recorded (not a recompute in
    backward, not a pipeline schedule's shape inference). A no-op outside `collect_aux_losses`."""
    if not _ACTIVE:
        yield
        return
    collector = _ACTIVE[-1]
    before, collector.counting = collector.counting, True
    try:
        yield
    finally:
        collector.counting = before


def step_totals() -> StepTotals | None:
    """The collecting step's global totals (None outside a training step, or when its caller gave none)."""
    return _ACTIVE[-1].totals if _ACTIVE else None


def counted_forward() -> bool:
    """Whether the forward now running is one to count statistics in: a step's real forward, or any forward
    outside a training step (not a recompute in backward, not a pipeline schedule's shape inference)."""
    return not _ACTIVE or _ACTIVE[-1].counting


class _AddAuxLoss(torch.autograd.Function):
    """Identity on x, recording the value of a counted forward; backward gives the value the collector's scale as
    its gradient."""

    @staticmethod
    def forward(ctx, x, value, collector, name, normalized):
        if collector.counting:
            collector.add(name, value, normalized)
        ctx.collector, ctx.value, ctx.normalized = collector, value.detach(), normalized
        return x

    @staticmethod
    def backward(ctx, grad):
        grad_value = None
        if ctx.needs_input_grad[1]:
            scale = ctx.collector.unit_scale if ctx.normalized else ctx.collector.scale
            scale = scale if isinstance(scale, torch.Tensor) else torch.tensor(scale)
            grad_value = scale.to(ctx.value.device, ctx.value.dtype).expand_as(ctx.value)
        return grad, grad_value, None, None, None


@torch.compiler.disable  # a compiled layer runs the function eagerly: its backward records into a Python dict
def report_aux_loss(name: str, value: torch.Tensor, x: torch.Tensor, normalized: bool = False) -> torch.Tensor:
    """Add `value` (a scalar sum over this micro-batch's tokens; with `normalized`, its share of the already
    normalised global figure) to the training objective as `name`; returns `x`, which the caller must use from
    here on (backward through it is what reaches the value)."""
    if not _ACTIVE or not torch.is_grad_enabled():
        return x
    return _AddAuxLoss.apply(x, value, _ACTIVE[-1], name, normalized)
