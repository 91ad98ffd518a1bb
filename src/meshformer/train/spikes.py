"""Loss spikes: a step whose loss jumps far above its recent level.

PaLM's authors restarted from a checkpoint about 100 steps before a spike and skipped the 200-500 batches around
it, by hand. With `runner_wrapper.loss_spike_factor: F` meshformer does it itself: a step whose loss exceeds F
times the mean of the last WINDOW finite losses (after the learning-rate warm-up, and once MIN_HISTORY losses
are known) is not logged or saved; the run reloads its newest good checkpoint and continues from there with the
batches that led to the spike skipped (a data offset recorded in every later checkpoint, so resume stays
exact). After MAX_ROLLBACKS rollbacks the run stops: the problem is then the model or the settings, not a batch.
"""

from __future__ import annotations

import math
from collections import deque

WINDOW = 20
MIN_HISTORY = 10
MAX_ROLLBACKS = 5


class SpikeDetector:
    def __init__(self, factor: float):
        self.factor = factor
        self.history: deque[tuple[int, float]] = deque(maxlen=WINDOW)  # (step, loss) of recent normal steps

    @property
    def enabled(self) -> bool:
        return self.factor > 0

    def mean(self) -> float:
        return sum(loss for _, loss in self.history) / len(self.history)

    def is_spike(self, step: int, loss: float, after_warmup: bool) -> bool:
        """True when `loss` of `step` is a spike; otherwise the loss joins the history."""
        if not self.enabled or not math.isfinite(loss):
            return False
        if after_warmup and len(self.history) >= MIN_HISTORY and loss > self.factor * self.mean():
            return True
        self.history.append((step, loss))
        return False

    def forget_after(self, step: int) -> None:
        """After rolling back to `step`: the losses of later steps belong to the abandoned trajectory."""
        kept = [(s, v) for s, v in self.history if s <= step]
        self.history.clear()
        self.history.extend(kept)
