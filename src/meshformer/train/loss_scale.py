"""Loss scaling for fp16 compute: MindSpore's `runner_wrapper.scale_sense`, torch GradScaler's rule.

fp16 keeps 5 exponent bits: small gradients underflow to zero. The loss is multiplied by a scale before backward
(so are all gradients), the gradients are divided by it before clipping and the update, and a step whose
gradients overflowed (a non-finite norm) is skipped. Dynamic scaling (`DynamicLossScaleUpdateCell`): an overflow
divides the scale by `scale_factor`; `scale_window` finite steps in a row multiply it by `scale_factor`.

    scale_sense: {type: DynamicLossScaleUpdateCell, loss_scale_value: 65536, scale_factor: 2, scale_window: 1000}
    scale_sense: {type: FixedLossScaleUpdateCell, loss_scale_value: 1024}      # or a number: a fixed scale

fp16 with no scale_sense gets the dynamic defaults above; bf16 and fp32 need none (a fixed 1.0, MindSpore's
usual setting, changes nothing). The scale and its count of good steps are saved with every checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshformer.config.scale_sense import scale_sense


@dataclass
class LossScaler:
    scale: float = 1.0
    dynamic: bool = False
    factor: float = 2.0
    window: int = 1000
    good_steps: int = 0  # finite steps since the last change

    @classmethod
    def from_config(cls, cfg) -> "LossScaler":
        sense = scale_sense(cfg)
        return cls(sense.scale, dynamic=sense.dynamic, factor=sense.factor, window=sense.window)

    def update(self, finite: bool) -> None:
        """After a step: an overflow shrinks the scale, a window of finite steps grows it (dynamic only)."""
        if not self.dynamic:
            return
        if not finite:
            self.scale = max(self.scale / self.factor, 1.0)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.window:
            self.scale *= self.factor
            self.good_steps = 0

    def state(self) -> dict:
        return {"loss_scale": self.scale, "loss_scale_good_steps": self.good_steps}

    def load(self, state: dict) -> None:
        if self.dynamic and "loss_scale" in state:
            self.scale = float(state["loss_scale"])
            self.good_steps = int(state.get("loss_scale_good_steps", 0))
