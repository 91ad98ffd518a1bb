"""Hooks: code a technique runs at fixed points of every training step, without editing the step.

A hook is any object with some of these methods (a missing one, or one set to None, is skipped; `TrainHook`
declares them all as None, to subclass). `step` is the step's number as metrics.jsonl counts it (1 for the
first; None when the caller of train_step gave none).

- `step_context(step)` -> a context manager or None: the step's whole forward/backward runs inside it (every
  micro-batch; under pipeline parallelism the schedule's one call). Activation measurement (train/memory.py),
  context parallelism's sequence sharding.
- `before_forward_backward(step, batch)`: the step's rows are this rank's (`batch`: a StepBatch of inputs,
  labels, documents and the micro-batch count) and no forward has run (an MoE model with the global_batch
  balancing loss routes the step's micro-batches once here, without gradients: train/moe_balance.py).
- `micro_batch_context(step, index)` -> a context manager or None: one micro-batch's forward and backward run
  inside it. A pipeline schedule interleaves its micro-batches inside one call, so there a hook with this method
  is refused (ValueError): such a technique wraps the step with `step_context`.
- `before_optimizer_step(step)`: the gradients are final (reduced, loss scale undone, clipped); the update has
  not run (an MoE router's bias update reads the step's expert loads here).
- `after_optimizer_step(step)`: the update was just queued and the gradients still exist (memory accounting).
  When the host decides that a non-finite step is skipped (foreach AdamW, offloaded states) neither optimizer
  hook runs for it; when the device decides (fused AdamW's found_inf) both run and the device skips the update.

Several hooks run in the order given; contexts nest in that order (the first outermost). Hooks reach a step
three ways: train_step(..., hooks=[...]); Trainer(cfg, hooks=[...]); or `register_hook(name, factory)` from a test
or a model transform's module: `factory(cfg, parts)` returns the hook for that run (or None: not wanted there),
and the Trainer calls every registered factory once its model is built.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

METHODS = (
    "step_context",
    "before_forward_backward",
    "micro_batch_context",
    "before_optimizer_step",
    "after_optimizer_step",
    "step_metrics",
)


@dataclass(frozen=True)
class StepBatch:
    """What `before_forward_backward` sees: this rank's rows of the step, split into `n_micro` micro-batches."""

    inputs: torch.Tensor
    labels: torch.Tensor
    documents: torch.Tensor | None
    n_micro: int


class TrainHook:
    """Base class of a hook: every method absent (None); a subclass defines the ones it needs (module docstring)."""

    step_context: Callable[[int | None], contextlib.AbstractContextManager | None] | None = None
    before_forward_backward: Callable[[int | None, StepBatch], None] | None = None
    micro_batch_context: Callable[[int | None, int], contextlib.AbstractContextManager | None] | None = None
    before_optimizer_step: Callable[[int | None], None] | None = None
    after_optimizer_step: Callable[[int | None], None] | None = None
    step_metrics: Callable[[int | None], dict | None] | None = None


class StepContext(TrainHook):
    """A hook for one step: its forward/backward runs inside `context` (a context manager, entered once)."""

    def __init__(self, context: contextlib.AbstractContextManager):
        self.context = context

    def step_context(self, step: int | None) -> contextlib.AbstractContextManager:
        return self.context


class Hooks:
    """The hooks of one run, called together at each point of the step."""

    def __init__(self, hooks: Iterable[Any] = ()):
        self.hooks = list(hooks)
        self._methods = {name: [m for h in self.hooks if (m := getattr(h, name, None)) is not None] for name in METHODS}

    @contextlib.contextmanager
    def step_context(self, step: int | None) -> Iterator[None]:
        with _entered(m(step) for m in self._methods["step_context"]):
            yield

    def before_forward_backward(self, step: int | None, batch: StepBatch) -> None:
        for m in self._methods["before_forward_backward"]:
            m(step, batch)

    def micro_batch_context(self, step: int | None) -> Callable[[int], contextlib.AbstractContextManager] | None:
        """What ModelParts.forward_backward enters for micro-batch `index` of this step; None when no hook has one."""
        methods = self._methods["micro_batch_context"]
        if not methods:
            return None
        return lambda index: _entered(m(step, index) for m in methods)

    def before_optimizer_step(self, step: int | None) -> None:
        for m in self._methods["before_optimizer_step"]:
            m(step)

    def after_optimizer_step(self, step: int | None) -> None:
        for m in self._methods["after_optimizer_step"]:
            m(step)

    def step_metrics(self, step: int | None) -> dict[str, float]:
        out: dict[str, float] = {}
        for m in self._methods["step_metrics"]:
            out.update(m(step) or {})
        return out


@contextlib.contextmanager
def _entered(contexts: Iterable[contextlib.AbstractContextManager | None]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for cm in contexts:
            if cm is not None:
                stack.enter_context(cm)
        yield


HookFactory = Callable[[Any, Any], Any]  # (MeshformerConfig, ModelParts) -> a hook, or None
REGISTERED: dict[str, HookFactory] = {}


def register_hook(name: str, factory: HookFactory) -> None:
    """Every Trainer built from now on asks `factory(cfg, parts)` for a hook (None: not for this run)."""
    if name in REGISTERED:
        raise ValueError(f"a training hook named {name!r} is already registered")
    REGISTERED[name] = factory


def unregister_hook(name: str) -> None:
    REGISTERED.pop(name, None)


def registered_hooks(cfg, parts) -> list:
    """The registered factories' hooks for this run, in registration order."""
    return [h for factory in REGISTERED.values() if (h := factory(cfg, parts)) is not None]
