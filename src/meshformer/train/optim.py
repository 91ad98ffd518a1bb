"""AdamW with the usual exclusions, layer-wise learning-rate decay, and warm-up + decay schedules."""

from __future__ import annotations

import math
import re

import torch

from meshformer.backends.torch_private import fused_optimizer_devices
from meshformer.config.schema import MeshformerConfig

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _layer_depth(name: str, num_layers: int) -> int:
    """0 for the embedding, i+1 for decoder layer i, num_layers+1 for the final norm and output head."""
    m = _LAYER.search(name)
    if m:
        return int(m.group(1)) + 1
    return 0 if "embed_tokens" in name else num_layers + 1


def param_groups(named_params, cfg: MeshformerConfig) -> list[dict]:
    """No weight decay on norms and biases (1-D tensors); lr multiplier layer_decay^(L+1-depth) per depth."""
    oc, mc = cfg.optimizer, cfg.model.model_config
    groups: dict[tuple, dict] = {}
    for name, p in named_params:
        if not p.requires_grad:
            continue
        decay = oc.weight_decay if p.ndim >= 2 and "norm" not in name else 0.0
        scale = 1.0
        if cfg.layer_decay < 1.0:
            scale = cfg.layer_decay ** (mc.num_layers + 1 - _layer_depth(name, mc.num_layers))
        g = groups.setdefault((decay, scale), {"params": [], "weight_decay": decay, "lr_scale": scale})
        g["params"].append(p)
    return list(groups.values())


def build_optimizer(named_params, cfg: MeshformerConfig) -> torch.optim.Optimizer:
    oc = cfg.optimizer
    betas = tuple(oc.betas) if oc.betas is not None else (oc.beta1, oc.beta2)
    lr = peak_lr(cfg)
    groups = param_groups(named_params, cfg)
    for g in groups:
        g["lr"] = lr * g["lr_scale"]
    fused = use_fused(oc.fused, [p for g in groups for p in g["params"]])
    foreach = oc.foreach and not fused
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=oc.eps, foreach=foreach, fused=fused or None)


def use_fused(setting: bool | None, params) -> bool:
    """optimizer.fused, or by default: fused wherever torch has the kernel (GPUs and CPUs): one pass over each
    tensor instead of foreach's several, no multi-tensor temporaries (it pays on a CPU too: docs/benchmarks.md,
    fused against foreach AdamW)."""
    if setting is not None:
        return setting
    supported = fused_optimizer_devices()
    return bool(params) and all(_local(p).device.type in supported for p in params)


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


class Optimizers:
    """One AdamW per model part (pipeline stage) this rank holds, driven as one.

    DCP maps optimizer state to parameter names through the module that owns the parameters, so a rank
    holding several stages (interleaved and V schedules) needs one optimizer per stage.
    """

    def __init__(self, parts, cfg: MeshformerConfig):
        self.items = [build_optimizer(p.named_parameters(), cfg) for p in parts]
        self._skips_on: dict[torch.device, bool] = {}  # skips_on_device, asked every step: parameters stay put

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.items for g in o.param_groups]

    def skips_on_device(self, device: torch.device) -> bool:
        """Every optimizer is fused with its parameters on `device`: torch's fused kernels then take a `found_inf`
        flag and skip the update on the device (the Adam step counts are restored), so a step whose gradients may
        be non-finite needs no host read before it (GradScaler drives them the same way). Not with parameters
        offloaded to the host (cpu_offload): the flag would have to travel there first."""
        if device not in self._skips_on:
            self._skips_on[device] = all(
                g["fused"] and all(_local(p).device == device for p in g["params"])
                for o in self.items
                for g in o.param_groups
            )
        return self._skips_on[device]

    def step(self, found_inf: torch.Tensor | None = None) -> None:
        """found_inf: a float device scalar, nonzero to skip the update (only where skips_on_device)."""
        for o in self.items:
            if found_inf is not None:
                o.found_inf = found_inf
            try:
                o.step()
            finally:
                o.__dict__.pop("found_inf", None)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.items:
            o.zero_grad(set_to_none=set_to_none)

    def state_tensors(self) -> list[torch.Tensor]:
        return [v for o in self.items for s in o.state.values() for v in s.values() if torch.is_tensor(v)]


def peak_lr(cfg: MeshformerConfig) -> float:
    ls = cfg.lr_schedule
    return ls.learning_rate if ls.learning_rate is not None else cfg.optimizer.learning_rate


def warmup_steps(cfg: MeshformerConfig, total: int) -> int:
    if cfg.optimizer.warmup_steps is not None:
        return cfg.optimizer.warmup_steps
    if cfg.lr_schedule.warmup_steps is not None:
        return cfg.lr_schedule.warmup_steps
    return int(cfg.lr_schedule.warmup_ratio * total)


def lr_at(step: int, *, peak: float, end: float, warmup: int, total: int, kind: str) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warm-up to peak, then decay to end at total."""
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    if kind in ("ConstantWarmUpLR", "constant"):
        return peak
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    if kind in ("LinearWithWarmUpLR", "linear"):
        return end + (peak - end) * (1.0 - progress)
    return end + (peak - end) * 0.5 * (1.0 + math.cos(math.pi * progress))


class Schedule:
    """Sets every param group's lr for a step (group lr = schedule lr x the group's layer-decay scale)."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: MeshformerConfig, total_steps: int):
        self.opt = optimizer
        ls = cfg.lr_schedule
        self.total = ls.total_steps if ls.total_steps > 0 else total_steps
        self.kw = dict(
            peak=peak_lr(cfg), end=ls.lr_end, warmup=warmup_steps(cfg, self.total), total=self.total, kind=ls.type
        )

    def lr(self, step: int) -> float:
        return lr_at(step, **self.kw)

    def apply(self, step: int) -> float:
        lr = self.lr(step)
        for g in self.opt.param_groups:
            g["lr"] = lr * g.get("lr_scale", 1.0)
        return lr


def _steps(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"


def _warmup_source(cfg: MeshformerConfig) -> str:
    """The field the warm-up length comes from (the precedence of warmup_steps)."""
    if cfg.optimizer.warmup_steps is not None:
        return f"optimizer.warmup_steps={cfg.optimizer.warmup_steps}"
    if cfg.lr_schedule.warmup_steps is not None:
        return f"lr_schedule.warmup_steps={cfg.lr_schedule.warmup_steps}"
    return f"lr_schedule.warmup_ratio={cfg.lr_schedule.warmup_ratio:g}"


def schedule_warnings(cfg: MeshformerConfig, run_steps: int) -> list[str]:
    """What the learning rate will do over a run of `run_steps` optimizer steps that the config does not show
    at a glance: a warm-up that outlasts the run or the schedule, a schedule that ends before the run. Step
    numbers are 1-based, as in the logs and metrics.jsonl; each statement follows from `lr_at`."""
    ls = cfg.lr_schedule
    total = ls.total_steps if ls.total_steps > 0 else run_steps
    warm, peak = warmup_steps(cfg, total), peak_lr(cfg)
    decays = ls.type not in ("ConstantWarmUpLR", "constant")
    if run_steps < 1:
        return []
    if warm >= run_steps:
        last = lr_at(run_steps - 1, peak=peak, end=ls.lr_end, warmup=warm, total=total, kind=ls.type)
        longer = "longer than" if warm > run_steps else "as long as"
        return [
            f"{_warmup_source(cfg)}: the warm-up ({_steps(warm)}) is {longer} the run ({_steps(run_steps)}): the "
            f"learning rate rises for the whole run, to {last:g} at its last step ({last / peak:.0%} of the peak "
            f"{peak:g})" + (", and never decays" if decays else "")
        ]
    if decays and warm >= total:  # lr_at: peak at steps warm and warm + 1, then lr_end at once (a span of 1 step)
        after = (
            f"then drops to lr_end={ls.lr_end:g} at step {warm + 2}, with no decay in between"
            if warm + 2 <= run_steps
            else "and stays there to the end of the run"
        )
        return [
            f"{_warmup_source(cfg)}: the warm-up ({_steps(warm)}) is not shorter than lr_schedule.total_steps={total}: "
            f"the learning rate reaches its peak {peak:g} at step {warm}, {after}"
        ]
    if decays and total < run_steps:
        return [
            f"lr_schedule.total_steps={total} is shorter than the run ({_steps(run_steps)}): the learning rate decays "
            f"to lr_end={ls.lr_end:g} by step {total + 1} and stays there for the remaining {_steps(run_steps - total)}"
        ]
    return []
