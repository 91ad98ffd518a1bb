"""MindSpore's `runner_wrapper.scale_sense` read and checked (the trainer's loss scaler, train/loss_scale.py, starts
from it; validation checks it before any process starts)."""

from __future__ import annotations

from dataclasses import dataclass

from meshformer.errors import UserError

DYNAMIC, FIXED = "DynamicLossScaleUpdateCell", "FixedLossScaleUpdateCell"
DEFAULTS = {"loss_scale_value": 65536.0, "scale_factor": 2.0, "scale_window": 1000}
FIELD = "runner_wrapper.scale_sense"


@dataclass(frozen=True)
class ScaleSense:
    """A loss scale setting: the starting scale, and whether and how it changes."""

    scale: float = 1.0
    dynamic: bool = False
    factor: float = 2.0
    window: int = 1000


def scale_sense(cfg) -> ScaleSense:
    """The run's loss scale setting, or one line naming what is wrong with `runner_wrapper.scale_sense`."""
    ss = cfg.runner_wrapper.scale_sense
    fp16 = cfg.model.model_config.compute_dtype == "float16"
    if isinstance(ss, bool) or (not isinstance(ss, (int, float, dict))):
        raise UserError(f"{FIELD}={ss!r}: give a number (a fixed scale) or a {DYNAMIC} mapping")
    if isinstance(ss, (int, float)):
        if ss <= 0:
            raise UserError(f"{FIELD}={ss}: a loss scale must be > 0")
        return ScaleSense(float(ss))
    if not ss:
        return ScaleSense(DEFAULTS["loss_scale_value"], dynamic=True) if fp16 else ScaleSense()
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
    return ScaleSense(
        float(value["loss_scale_value"]),
        dynamic=kind == DYNAMIC,
        factor=float(value["scale_factor"]),
        window=int(value["scale_window"]),
    )
