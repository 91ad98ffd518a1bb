"""An auxiliary loss reported from every decoder layer (coef x the sum of squares of its output), for
tests/parity/test_trainer_hooks.py: in one process, and under torchrun (dp2, pp2) through the trainer's own step.

usage: torchrun --nproc-per-node 2 tests/dist/aux_case.py OUT.json CASE ...   (CASE: a harness case name)
The metrics rank of each case writes {"CASE": [[loss, grad_norm, aux], ...]} into OUT.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from meshformer.models.aux_loss import report_aux_loss  # noqa: E402
from meshformer.models.transforms import ModelTransform  # noqa: E402
from meshformer.parallel import init_parallel  # noqa: E402
from meshformer.train.optim import Optimizers  # noqa: E402
from meshformer.train.step import build_parts  # noqa: E402

COEF = 0.01
NAME = "sq"
STEPS = 3
RECORDED: list[torch.Tensor] = []  # every value a layer reported, in forward order, with its graph (for by-hand sums)


class _ReportsSquares:
    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        value = COEF * out.float().pow(2).sum()
        RECORDED.append(value)
        return report_aux_loss(NAME, value, out)


_SUBCLASSES: dict[type, type] = {}


def _report_squares(model, cfg) -> None:
    """Each decoder layer's class becomes a subclass whose forward reports (parameter names stay the same)."""
    for layer in model.layers.values():
        cls = type(layer)
        if cls not in _SUBCLASSES:
            _SUBCLASSES[cls] = type(f"ReportsSquares{cls.__name__}", (_ReportsSquares, cls), {})
        layer.__class__ = _SUBCLASSES[cls]


TRANSFORM = ModelTransform("report squares", lambda cfg: True, _report_squares)


def run(case: str | None, world_size: int | None = None, steps: int = STEPS) -> tuple[list[list[float]], object]:
    """[loss, grad norm, logged aux loss] of each step of `case` (None: one process), and the env: the harness's
    steps (harness.train_steps, the trainer's step on its fixed batches) on the model with TRANSFORM."""
    cfg = harness.make_cfg(harness.CASES[case][0] if case else {})
    env = init_parallel(cfg, world_size)
    n_micro = harness.CASES[case][1] if case else 1
    built = build_parts(cfg, env, [TRANSFORM])
    opt = Optimizers(built.parts.parts, cfg)
    rows = harness.train_steps(built.parts, opt, cfg, env, n_micro, range(steps))
    # (loss, grad norm, *the aux losses by name): this model reports NAME alone; nan if it went missing
    return [[loss, grad_norm, *(aux or [float("nan")])] for loss, grad_norm, *aux in rows], env


def main() -> None:
    import torch.distributed as dist

    out_path, cases = Path(sys.argv[1]), sys.argv[2:]
    results, env = {}, None
    for case in cases:
        res, env = run(case)
        if env.is_metrics_rank:
            results[case] = res
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        out_path.write_text(json.dumps({k: v for r in gathered for k, v in r.items()}))
    env.shutdown()


if __name__ == "__main__":
    main()
