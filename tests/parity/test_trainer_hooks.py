"""Training hooks (train/hooks.py) and auxiliary losses (models/aux_loss.py) in real training steps."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import DIST, FP32_RTOL, ROOT, TORCHRUN, rel, tiny_overrides, torchrun_env
from meshformer.config import load_config
from meshformer.train import hooks as train_hooks
from meshformer.train.hooks import Hooks, TrainHook
from meshformer.train.trainer import run_training

sys.path.insert(0, str(DIST))
import aux_case  # noqa: E402
import harness  # noqa: E402


class Recorder(TrainHook):
    """Every call, in order, with its step; checks that gradients exist where the docs say they do."""

    def __init__(self, parts=None):
        self.events: list[tuple] = []
        self.parts = parts

    @contextlib.contextmanager
    def _span(self, *what):
        self.events.append(("enter", *what))
        yield
        self.events.append(("exit", *what))

    def step_context(self, step):
        return self._span("step", step)

    def micro_batch_context(self, step, index):
        return self._span("micro", step, index)

    def _grads_exist(self) -> bool:
        return self.parts is not None and all(p.grad is not None for p in self.parts.parameters())

    def before_optimizer_step(self, step):
        self.events.append(("before_optimizer", step, self._grads_exist()))

    def after_optimizer_step(self, step):
        self.events.append(("after_optimizer", step, self._grads_exist()))


def _expected(steps: int, micro: int, grads: bool) -> list[tuple]:
    out = []
    for s in range(1, steps + 1):
        out.append(("enter", "step", s))
        for i in range(micro):
            out += [("enter", "micro", s, i), ("exit", "micro", s, i)]
        out += [("exit", "step", s), ("before_optimizer", s, grads), ("after_optimizer", s, grads)]
    return out


def test_hooks_see_every_step_in_order_in_a_real_run(tiny_dataset, tmp_path):
    """A hook given to the trainer and one a registered factory makes see the same calls, in the step's order,
    numbered as metrics.jsonl numbers the steps; the registered one is built with the run's ModelParts and sees the
    gradients before and after the update."""
    given, made = Recorder(), []

    def factory(cfg, parts):
        made.append(Recorder(parts))
        return made[-1]

    train_hooks.register_hook("test recorder", factory)
    try:
        with pytest.raises(ValueError, match="already registered"):
            train_hooks.register_hook("test recorder", factory)
        extra = {"runner_config.stop_step": 3, "train_dataset.batch_size": 2}
        extra["runner_config.gradient_accumulation_steps"] = 2
        run_training(load_config(None, tiny_overrides(tiny_dataset, tmp_path / "run", extra)), hooks=[given])
    finally:
        train_hooks.unregister_hook("test recorder")
    assert "test recorder" not in train_hooks.REGISTERED
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert given.events == _expected(3, 2, grads=False)  # no parts: grads not looked at
    assert len(made) == 1 and made[0].events == _expected(3, 2, grads=True)


def test_a_micro_batch_context_is_refused_under_pipeline_parallelism():
    from meshformer.parallel.pipeline_parts import PipelineParts

    parts = PipelineParts.__new__(PipelineParts)  # the check comes before anything is touched
    with pytest.raises(ValueError, match="micro_batch_context cannot run under pipeline parallelism"):
        parts.forward_backward(None, None, 2, 1.0, micro_context=Hooks([Recorder()]).micro_batch_context(1))
    assert Hooks([object()]).micro_batch_context(1) is None  # a hook without the method: nothing to refuse


# ---------------------------------------------------------------- auxiliary losses


def _grads(parts) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in parts.named_parameters()}


def test_aux_loss_gradient_and_value_are_those_of_the_summed_objective():
    """Through train_step (2 micro-batches): the gradient equals autograd of (main_sum + aux_sum) / n_tokens by hand,
    it differs from the main loss's alone, and the logged aux loss is the reported sum / n_tokens."""
    from meshformer.parallel import init_parallel
    from meshformer.train.optim import Optimizers
    from meshformer.train.step import build_parts, train_step

    cfg = harness.make_cfg({})
    env = init_parallel(cfg, 1)
    parts = build_parts(cfg, env, [aux_case.TRANSFORM]).parts
    model = parts.parts[0]
    inputs, labels, _ = harness.batches()
    x, y = inputs[0], labels[0]
    n_tok = (y != -100).sum()

    def by_hand(with_aux: bool) -> dict[str, torch.Tensor]:
        aux_case.RECORDED.clear()
        main = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")
        aux = torch.stack(aux_case.RECORDED).sum() if with_aux else 0.0
        assert len(aux_case.RECORDED) == len(model.layers)  # every layer reported (nothing collects outside a step)
        ((main + aux) / n_tok).backward()
        grads = _grads(parts)
        model.zero_grad(set_to_none=True)
        return grads

    want, main_only = by_hand(True), by_hand(False)
    assert max(rel(want[n].norm().item(), main_only[n].norm().item()) for n in want) > 1e-2  # the aux term matters

    class Capture(TrainHook):
        def before_optimizer_step(self, step):
            self.grads = _grads(parts)

    capture = Capture()
    aux_case.RECORDED.clear()
    r = train_step(
        parts,
        Optimizers(parts.parts, cfg),
        env,
        x,
        y,
        n_micro=2,
        ignore_index=-100,
        max_grad_norm=None,
        hooks=[capture],
        step=1,
    )
    for name, g in want.items():
        torch.testing.assert_close(capture.grads[name], g, rtol=1e-5, atol=1e-7, msg=name)
    assert len(aux_case.RECORDED) == 2 * len(model.layers)  # both micro-batches, every layer
    logged = (torch.stack(aux_case.RECORDED).detach().sum() / n_tok).item()
    assert set(r.aux_losses) == {aux_case.NAME} and rel(r.aux_losses[aux_case.NAME], logged) < 1e-6


def test_aux_loss_is_logged_by_the_trainer(tiny_dataset, tmp_path, monkeypatch):
    """metrics.jsonl has `aux_loss/sq` every step (and `loss` stays the main loss); TensorBoard has the scalar."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from meshformer.models import transforms

    monkeypatch.setattr(transforms, "TRANSFORMS", (*transforms.TRANSFORMS, aux_case.TRANSFORM))
    extra = {"runner_config.stop_step": 3, "tensorboard.tensorboard_dir": str(tmp_path / "tb")}
    run_training(load_config(None, tiny_overrides(tiny_dataset, tmp_path / "run", extra)))
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert all(r["aux_loss/sq"] > 0 for r in recs) and all(r["loss"] < 7 for r in recs)  # ln(512) = 6.2
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    got = [e.value for e in acc.Scalars("aux_loss/sq")]
    assert [rel(a, r["aux_loss/sq"]) < 1e-6 for a, r in zip(got, recs)] == [True] * 3


def test_aux_loss_two_processes_dp2_and_pp2_match_one_process(tmp_path):
    """dp2 (recompute, 2 micro-batches) and pp2 (1F1B, 4 micro-batches, recompute; the aux loss's gradient flows on
    the first stage too, its value is summed over the stages, the schedule's shape inference does not count) give
    the one-process loss, grad norm and logged aux loss within 1e-5 (fp32). A recomputed layer reports once."""
    reference, _ = aux_case.run(None, world_size=1)
    out = tmp_path / "r.json"
    cases = ["dp2_rc_accum", "pp2_1f1b_rc"]
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", str(DIST / "aux_case.py"), str(out), *cases]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=torchrun_env(), cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    results = json.loads(out.read_text())
    bad = [
        f"{case} step {step}: {what} {got} vs {want}"
        for case in cases
        for step, (row, ref) in enumerate(zip(results[case], reference), 1)
        for what, got, want in zip(("loss", "grad_norm", "aux"), row, ref)
        if not rel(got, want) <= FP32_RTOL
    ]
    assert len(results["pp2_1f1b_rc"]) == aux_case.STEPS and not bad, "\n".join(bad)
