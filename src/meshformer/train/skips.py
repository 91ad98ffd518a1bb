"""Optimizer steps skipped for a non-finite loss or gradient norm (train/step.py decides on every rank alike).

One bad batch must not end a run, a diverging run must: `runner_wrapper.max_consecutive_skips` non-finite steps in
a row stop it (RunFailed, naming the newest checkpoint saved with a finite loss). An fp16 overflow under dynamic
loss scaling (a finite loss with overflowed gradients) is routine, not bad data: it lowers the scale and does not
count towards the limit. The run's count of skipped steps is this component's part of trainer_state.json.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from meshformer.checkpoint import store
from meshformer.errors import RunFailed
from meshformer.train.step import StepResult


class SkippedSteps:
    def __init__(self, max_in_a_row: int, log: Callable[[str], None]):
        self.max_in_a_row, self.log = max_in_a_row, log
        self.total = 0  # optimizer steps skipped for a non-finite loss or gradient norm, whole run
        self.in_a_row = 0  # non-finite steps in a row, fp16 overflows not counted
        self.last_finite = True  # the newest step's loss and norm (saved as "finite": pruning keeps a finite one)
        self.overflow = False

    def state_dict(self) -> dict:
        return {"skipped_steps": self.total}

    def load_state_dict(self, state: dict) -> None:
        self.total = int(state.get("skipped_steps", 0))

    def count(self, result: StepResult, dynamic_scaling: bool) -> None:
        """Right after the step: the counts include it."""
        self.total += result.skipped
        self.last_finite = math.isfinite(result.loss) and math.isfinite(result.grad_norm)
        self.overflow = dynamic_scaling and math.isfinite(result.loss)
        self.in_a_row = self.in_a_row + 1 if result.skipped and not self.overflow else 0

    def report(self, done: int, result: StepResult, scale_used: float, scale_now: float) -> None:
        """The console line of a skipped step."""
        if result.skipped and self.overflow:
            self.log(
                f"step {done}: gradients overflowed at loss scale {scale_used:g}: step skipped, scale now {scale_now:g}"
            )
        elif result.skipped:
            self.log(
                f"step {done}: loss {result.loss} / grad norm {result.grad_norm} is not finite: optimizer step "
                f"skipped ({self.in_a_row} in a row, the run stops at {self.max_in_a_row})"
            )

    @property
    def exhausted(self) -> bool:
        return self.in_a_row >= self.max_in_a_row

    def failure(self, done: int, out: Path) -> RunFailed:
        """The error that stops the run (call once every save has completed)."""
        good = [c for c in store.list_checkpoints(out) if store.saved_finite(c)]
        return RunFailed(
            f"{self.in_a_row} steps in a row (to step {done}) had a non-finite loss or gradient norm: "
            f"the run stopped. Newest checkpoint saved with a finite loss: "
            f"{good[-1].name if good else 'none'}. Lower learning_rate, check the data near step {done}, "
            f"then resume (load_checkpoint: that checkpoint)"
        )
