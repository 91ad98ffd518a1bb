"""MoE load balancing (models/moe/balance.py, train/moe_balance.py): each balancing loss against its formula,
the step's losses and gradients the same for every accumulation split, the routing-bias update, counts under
recompute, metrics, resume, and the configs refused."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from conftest import DIST, ROOT, tiny_overrides
from meshformer.config import load_config
from meshformer.errors import UserError
from meshformer.models.aux_loss import StepTotals, collect_aux_losses, counting_aux_losses
from meshformer.models.moe import MoEBlock
from meshformer.train.hooks import TrainHook
from meshformer.train.moe_balance import MoeBalanceHook, moe_blocks
from meshformer.train.trainer import run_training

sys.path.insert(0, str(DIST))
import harness  # noqa: E402
from test_moe_layer import moe_config  # noqa: E402

M = "model.model_config."
MOE = f"{M}moe_config."
E, K = 8, 2
BALANCED = {
    M + "type": "Qwen3MoeConfig", MOE + "expert_num": E, MOE + "num_experts_chosen": K,
    MOE + "moe_intermediate_size": 32, MOE + "aux_loss_types": "[global_batch, sequence]",
    MOE + "aux_loss_factors": "[0.01, 0.02]", MOE + "z_loss_factor": 0.001,
    MOE + "balance_via_topk_bias": True, MOE + "topk_bias_update_rate": 0.01,
}  # fmt: skip


# ---------------------------------------------------------------------------------------------------- the formulas
def _random_block(sigmoid: bool):
    mc = moe_config(
        expert_num=E, num_experts_chosen=K, moe_intermediate_size=16, use_gating_sigmoid=sigmoid,
        aux_loss_types="[global_batch, sequence, micro_batch]", aux_loss_factors="[0.1, 0.2, 0.3]", z_loss_factor=0.05,
    )  # fmt: skip
    block = MoEBlock(mc, 0)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.4)
    return block


def _direct_losses(block, x):
    """Each loss straight from its definition, with loops: alpha x sum_e f_e P_e, f_e = E/(kT) x tokens choosing e,
    P_e = mean normalised score over the same T tokens."""
    b, s, _ = x.shape
    route = block.gate(x.reshape(b * s, -1))
    p = route.scores / route.scores.sum(-1, keepdim=True)
    idx = route.indices.view(b, s, K)

    def fp(tokens_idx, probs):
        t = probs.shape[0]
        f = torch.stack([(tokens_idx == e).sum() for e in range(E)]).float() * E / (K * t)
        return (f * probs.mean(0)).sum()

    seq = sum(fp(idx[i], p.view(b, s, E)[i]) for i in range(b)) / b
    glob = fp(idx.reshape(-1, K), p)
    z = (torch.logsumexp(route.logits, -1) ** 2).mean()
    return {"moe_global_batch": 0.1 * glob, "moe_sequence": 0.2 * seq, "moe_micro_batch": 0.3 * glob, "moe_z": 0.05 * z}


@pytest.mark.parametrize("sigmoid", [False, True])
def test_each_balancing_loss_and_its_gradient_follow_the_formula(sigmoid):
    block = _random_block(sigmoid)
    x = torch.randn(3, 10, 32, generator=torch.Generator().manual_seed(12))
    direct = _direct_losses(block, x)
    with torch.no_grad():  # what the routing pre-pass would have summed (one rank, one micro-batch)
        route = block.gate(x.reshape(30, -1))
        block.stats.global_counts = torch.bincount(route.indices.reshape(-1), minlength=E).double()
    unit = 3.0  # a gradient-averaging size x loss scale: what every normalised aux loss's gradient is
    with collect_aux_losses(scale=0.0, unit_scale=unit, totals=StepTotals(30.0, 3.0, 1.0)) as aux:
        with counting_aux_losses():
            out = block(x)
        out.sum().backward()
    assert set(aux.sums) == set(direct) and aux.normalized == set(direct)
    for name, want in direct.items():
        assert aux.sums[name].item() == pytest.approx(want.item(), rel=1e-6), name
    got = block.gate.weight.grad.clone()
    block.zero_grad()
    (block(x).sum() + unit * sum(direct.values())).backward()  # no collector: the block alone, plus the formulas
    want = block.gate.weight.grad  # fp32 sums in another order: 1e-5 of the gradient's scale
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


# --------------------------------------------------------------------------------------- accumulation and recompute
class GradCapture(TrainHook):
    """Every parameter's gradient as the optimizer would see it."""

    def __init__(self, parts):
        self.parts, self.grads = parts, {}

    def before_optimizer_step(self, step):
        from meshformer.models.init import canonical_name  # recompute wraps layers: names without the wrapper

        named = self.parts.named_parameters()
        self.grads = {canonical_name(n): p.grad.detach().clone() for n, p in named if p.grad is not None}


def _step(overrides: dict, n_micro: int, rows: int = 8, steps: int = 2):
    """[(StepResult, grads)] of `steps` train_steps of the harness's tiny model made MoE, one process."""
    from meshformer.parallel import init_parallel
    from meshformer.train.optim import Optimizers
    from meshformer.train.step import build_parts, clip_threshold, train_step

    cfg = harness.make_cfg({**BALANCED, **overrides})
    env = init_parallel(cfg, None)
    parts = build_parts(cfg, env).parts
    opt = Optimizers(parts.parts, cfg)
    grads, balance = GradCapture(parts), MoeBalanceHook.for_run(cfg, parts)
    inputs, labels, _ = harness.batches()
    out = []
    for s in range(steps):
        r = train_step(
            parts, opt, env, inputs[s, :rows], labels[s, :rows], n_micro=n_micro, ignore_index=-100,
            max_grad_norm=clip_threshold(cfg), hooks=[balance, grads], step=s + 1,
        )  # fmt: skip
        out.append((r, grads.grads, balance.loads.clone()))
    biases = [b.gate.e_score_correction_bias.clone() for b in moe_blocks(parts)]
    return out, biases, parts


def test_logged_aux_losses_gradients_and_biases_do_not_depend_on_the_accumulation_split():
    runs = {n: _step({}, n) for n in (1, 2, 4)}
    (ref, ref_bias, _) = runs[1]
    for n in (2, 4):
        got, bias, _ = runs[n]
        for (a, ga, la), (b, gb, lb) in zip(ref, got):
            assert set(a.aux_losses) == {"moe_global_batch", "moe_sequence", "moe_z"}
            for name in a.aux_losses:
                assert b.aux_losses[name] == pytest.approx(a.aux_losses[name], rel=1e-6, abs=1e-9), (n, name)
            assert b.loss == pytest.approx(a.loss, rel=1e-6) and b.grad_norm == pytest.approx(a.grad_norm, rel=1e-6)
            for name in ga:
                torch.testing.assert_close(gb[name], ga[name], rtol=1e-5, atol=1e-6, msg=f"{n} micro: {name}")
            assert torch.equal(la, lb)
        for x, y in zip(ref_bias, bias):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-7)
    # The balancing loss is not trivially zero: balanced load gives alpha, each layer adds its own
    assert ref[0][0].aux_losses["moe_global_batch"] == pytest.approx(4 * 0.01, rel=0.5)


def test_micro_batch_loss_is_the_layout_dependent_one():
    over = {MOE + "aux_loss_types": "[micro_batch]", MOE + "aux_loss_factors": "[0.01]"}
    one, _, _ = _step(over, 1, steps=1)
    four, _, _ = _step(over, 4, steps=1)
    a, b = one[0][0].aux_losses["moe_micro_batch"], four[0][0].aux_losses["moe_micro_batch"]
    assert a != pytest.approx(b, rel=1e-4)  # f from 2 rows at a time, not 8: documented as layout-dependent


def test_recompute_does_not_count_twice_and_gives_the_same_step():
    plain, plain_bias, _ = _step({}, 2)
    rc, rc_bias, _ = _step({"recompute_config.recompute": True}, 2)
    for (a, ga, la), (b, gb, lb) in zip(plain, rc):
        assert torch.equal(la, lb)
        assert la.sum(dim=1).tolist() == [8 * harness.SEQ * K] * 4  # each token's k choices, once
        assert b.aux_losses == pytest.approx(a.aux_losses, rel=1e-6)
        for name in ga:
            torch.testing.assert_close(gb[name], ga[name], rtol=1e-5, atol=1e-6)
    for x, y in zip(plain_bias, rc_bias):
        assert torch.equal(x, y)


def test_bias_moves_against_the_load_by_the_rate():
    rate = BALANCED[MOE + "topk_bias_update_rate"]
    steps, biases, _ = _step({MOE + "aux_loss_types": "[]", MOE + "aux_loss_factors": "[]"}, 2, steps=1)
    loads = steps[0][2]
    assert loads.shape == (4, E)
    for load, bias in zip(loads, biases):
        sign = torch.sign(load.mean() - load)
        torch.testing.assert_close(bias, (rate * (sign - sign.mean())).float(), rtol=0, atol=1e-8)
        assert (bias[load > load.mean()] < 0).all() and (bias[load < load.mean()] > 0).all()
    # the counted loads are the routes of the step's tokens, checked by hand on a fresh model
    _, _, parts = _step({}, 1, steps=0)
    inputs, labels, _ = harness.batches()
    for b in moe_blocks(parts):
        b.stats.reset()
    parts.eval_loss(inputs[0, :8], labels[0, :8])  # outside a step every forward counts
    hand = torch.stack([b.stats.tokens_per_expert for b in moe_blocks(parts)]).double()
    torch.testing.assert_close(hand, loads)


# ------------------------------------------------------------------------------------------- trainer, metrics, resume
def _train(dataset, out, extra):
    moe = {
        M + "type": "Qwen3MoeConfig", MOE + "expert_num": 4, MOE + "num_experts_chosen": 2,
        MOE + "moe_intermediate_size": 16, MOE + "aux_loss_types": "[sequence]", MOE + "aux_loss_factors": "[0.01]",
        MOE + "balance_via_topk_bias": True, MOE + "capacity_factor": 1.0, "lr_schedule.total_steps": 8,
    }  # fmt: skip
    run_training(load_config(None, tiny_overrides(dataset, out, {**moe, **extra})))
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_trainer_logs_moe_metrics_plots_them_and_resumes_the_bias_exactly(tiny_dataset, tmp_path):
    from meshformer.observe.plot import drawn_panels

    common = {"callbacks": "[{type: CheckpointMonitor, save_checkpoint_steps: 3}]"}
    full = _train(tiny_dataset, tmp_path / "full", {**common, "runner_config.stop_step": 6})
    for key in ("aux_loss/moe_sequence", "moe/imbalance/layer0", "moe/imbalance/layer1", "moe/imbalance_max"):
        assert all(key in r for r in full), key
    assert all(r["moe/imbalance_max"] >= 1.0 and 0 <= r["moe/dropped/layer1"] < 1 for r in full)
    assert any(r["moe/dropped_mean"] > 0 for r in full)  # capacity 1.0 drops some pairs of a random router
    titles = {title: keys for title, keys, _ in drawn_panels(full)}
    assert "moe/imbalance/layer1" in titles["MoE load imbalance (max/mean tokens per expert)"]
    assert "aux_loss/moe_sequence" in titles["auxiliary losses"]
    part = tmp_path / "part"
    _train(tiny_dataset, part, {**common, "runner_config.stop_step": 3})
    resumed = _train(tiny_dataset, part, {**common, "runner_config.stop_step": 6, "resume_training": True})
    for a, b in zip(full, resumed):  # the bias moved in steps 1-3 comes back from the checkpoint
        for key in ("loss", "grad_norm", "moe/imbalance_max", "aux_loss/moe_sequence"):
            assert a[key] == b[key], (key, a, b)


# ----------------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "extra, words",
    [
        ({MOE + "capacity_factor": 0}, "capacity_factor"),
        ({MOE + "capacity_factor": -1.5}, "capacity_factor"),
        ({MOE + "aux_loss_types": "[device]", MOE + "aux_loss_factors": "[0.1]"}, "aux_loss_types"),
        ({MOE + "aux_loss_types": "[sequence]", MOE + "aux_loss_factors": "[]"}, "aux_loss_factors"),
        ({"parallel_config.pipeline_stage": 2, "parallel_config.micro_batch_num": 2}, "global_batch"),
    ],
)
def test_bad_balancing_configs_are_one_line_exit_2(tiny_dataset, tmp_path, extra, words):
    moe = {M + "type": "Qwen3MoeConfig", MOE + "expert_num": 4, MOE + "num_experts_chosen": 2}
    moe |= {MOE + "aux_loss_factor": 0.01}
    args = tiny_overrides(tiny_dataset, tmp_path / "run", {**moe, **extra})
    from meshformer.config.validate import validate_config

    with pytest.raises(UserError, match=words):
        validate_config(load_config(None, args))
    if words == "global_batch":  # the whole CLI: one line on stderr, exit 2, no traceback
        res = subprocess.run(
            [sys.executable, "-m", "meshformer", "train", str(ROOT / "tests" / "empty.yaml"), *args],
            capture_output=True, text=True, cwd=ROOT, timeout=120,
        )  # fmt: skip
        assert res.returncode == 2 and "Traceback" not in res.stderr
        assert len(res.stderr.strip().splitlines()) == 1 and "global_batch" in res.stderr


def test_uniform_load_gives_alpha_per_layer():
    """The normalisation: with every expert chosen equally and uniform scores, alpha x sum f.P = alpha."""
    from meshformer.models.moe.balance import LOSSES
    from meshformer.models.moe.router import RouterOutput

    block = _random_block(False)
    n = 16
    indices = torch.stack([torch.arange(n) % E, (torch.arange(n) + 1) % E], 1)
    scores = torch.full((n, E), 1 / E)
    route = RouterOutput(torch.zeros(n, E), scores, indices, torch.full((n, K), 0.5))
    counts = torch.bincount(indices.reshape(-1), minlength=E)
    block.stats.global_counts = counts.double()
    totals = StepTotals(float(n), 2.0, 1.0)
    for kind in ("global_batch", "micro_batch"):
        assert LOSSES[kind](block, route, counts, (2, 8), totals).item() == pytest.approx(1.0)
    assert math.isclose(LOSSES["sequence"](block, route, counts, (2, 8), totals).item(), 1.0, rel_tol=1e-6)
