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

from meshformer.errors import UserError

DYNAMIC, FIXED = "DynamicLossScaleUpdateCell", "FixedLossScaleUpdateCell"
DEFAULTS = {"loss_scale_value": 65536.0, "scale_factor": 2.0, "scale_window": 1000}
FIELD = "runner_wrapper.scale_sense"


@dataclass
class LossScaler:
    scale: float = 1.0
    dynamic: bool = False
    factor: float = 2.0
    window: int = 1000
    good_steps: int = 0  # finite steps since the last change

    @classmethod
    def from_config(cls, cfg) -> "LossScaler":
        ss = cfg.runner_wrapper.scale_sense
        fp16 = cfg.model.model_config.compute_dtype == "float16"
        if isinstance(ss, bool) or (not isinstance(ss, (int, float, dict))):
            raise UserError(f"{FIELD}={ss!r}: give a number (a fixed scale) or a {DYNAMIC} mapping")
        if isinstance(ss, (int, float)):
            if ss <= 0:
                raise UserError(f"{FIELD}={ss}: a loss scale must be > 0")
            return cls(float(ss))
        if not ss:
            return cls(DEFAULTS["loss_scale_value"], dynamic=True) if fp16 else cls()
        kind = ss.get("type", DYNAMIC)
        unknown = set(ss) - {"type", *DEFAULTS}
        if kind not in (DYNAMIC, FIXED) or unknown:
            what = f"type {kind!r}" if kind not in (DYNAMIC, FIXED) else f"key {sorted(unknown)[0]!r}"
            raise UserError(
                f"{FIELD}: unknown {what}: use type {DYNAMIC} (loss_scale_value, scale_factor, scale_window) or "
                f"{FIXED} (loss_scale_value)"
            )
        value = {**DEFAULTS, **{k: v for k, v in ss.items() if k != "type"}}
        if not (value["loss_scale_value"] > 0 and value["scale_factor"] > 1 and int(value["scale_window"]) >= 1):
            raise UserError(
                f"{FIELD}: loss_scale_value must be > 0, scale_factor > 1 and scale_window >= 1 (got "
                f"{value['loss_scale_value']}, {value['scale_factor']}, {value['scale_window']})"
            )
        return cls(
            float(value["loss_scale_value"]),
            dynamic=kind == DYNAMIC,
            factor=float(value["scale_factor"]),
            window=int(value["scale_window"]),
        )

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
