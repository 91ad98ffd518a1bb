"""Early stopping on the validation loss (`runner_config.early_stopping_patience`).

After every evaluation: a loss lower than the best so far by more than MIN_DELTA (relative) is a new best, and the
trainer saves a checkpoint marked `best` there (pruning keeps the newest such checkpoint whatever
keep_checkpoint_max says); after `patience` evaluations in a row without a new best the run stops. The best loss
and the count are saved in trainer_state.json, so a resumed run goes on counting where it stopped.
"""

from __future__ import annotations

import math

MIN_DELTA = 1e-4  # relative improvement that counts as one (noise in the last digits must not reset the count)


class EarlyStopping:
    def __init__(self, patience: int, state: dict | None = None):
        self.patience = patience
        state = state or {}
        best = state.get("best_eval_loss")
        self.best = float(best) if isinstance(best, (int, float)) else math.inf  # None: no evaluation yet
        self.since_best = int(state.get("evals_since_best", 0))

    @property
    def enabled(self) -> bool:
        return self.patience > 0

    def update(self, loss: float) -> bool:
        """Record one evaluation; True when it is a new best."""
        if math.isfinite(loss) and loss < self.best * (1 - MIN_DELTA):
            self.best, self.since_best = loss, 0
            return True
        self.since_best += 1
        return False

    @property
    def should_stop(self) -> bool:
        return self.enabled and self.since_best >= self.patience

    def state(self) -> dict:
        return {"best_eval_loss": self.best if math.isfinite(self.best) else None, "evals_since_best": self.since_best}
