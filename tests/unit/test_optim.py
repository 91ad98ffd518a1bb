"""Learning-rate schedules against their closed forms, and AdamW parameter groups."""

from __future__ import annotations

import math

import pytest
import torch

from meshformer.config import load_config
from meshformer.models import create_model
from meshformer.train.optim import Schedule, build_optimizer, lr_at, param_groups

TINY = [
    "--model.model_config.hidden_size",
    "16",
    "--model.model_config.num_layers",
    "3",
    "--model.model_config.num_heads",
    "2",
    "--model.model_config.vocab_size",
    "32",
    "--model.model_config.seq_length",
    "8",
    "--model.model_config.qkv_has_bias",
    "true",
]


def test_warmup_is_linear_and_reaches_peak():
    kw = dict(peak=1.0, end=0.1, warmup=4, total=20, kind="CosineWithWarmUpLR")
    assert [lr_at(s, **kw) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]


@pytest.mark.parametrize("kind", ["CosineWithWarmUpLR", "cosine"])
def test_cosine_matches_closed_form(kind):
    peak, end, warm, total = 3e-4, 3e-5, 10, 110
    for s in range(warm, total + 5):
        p = min(1.0, (s - warm) / (total - warm))
        want = end + (peak - end) * 0.5 * (1 + math.cos(math.pi * p))
        assert lr_at(s, peak=peak, end=end, warmup=warm, total=total, kind=kind) == pytest.approx(want, rel=1e-12)
    assert lr_at(total, peak=peak, end=end, warmup=warm, total=total, kind=kind) == pytest.approx(end)


def test_linear_and_constant():
    kw = dict(peak=2.0, end=0.0, warmup=0, total=10)
    assert [lr_at(s, kind="linear", **kw) for s in (0, 5, 10, 12)] == [2.0, 1.0, 0.0, 0.0]
    assert {lr_at(s, kind="ConstantWarmUpLR", **kw) for s in range(12)} == {2.0}


def test_total_steps_fixes_schedule_independently_of_stop_step():
    model = create_model(load_config(None, TINY).model.model_config, 0)
    a = load_config(None, TINY + ["--lr_schedule.total_steps", "100", "--runner_config.stop_step", "10"])
    b = load_config(None, TINY + ["--lr_schedule.total_steps", "100", "--runner_config.stop_step", "50"])
    sa = Schedule(build_optimizer(model.named_parameters(), a), a, total_steps=10)
    sb = Schedule(build_optimizer(model.named_parameters(), b), b, total_steps=50)
    assert [sa.lr(s) for s in range(10)] == [sb.lr(s) for s in range(10)]
    c = load_config(None, TINY + ["--lr_schedule.warmup_ratio", "0.1"])
    assert Schedule(build_optimizer(model.named_parameters(), c), c, total_steps=50).kw["warmup"] == 5


def test_no_weight_decay_on_norms_and_biases():
    cfg = load_config(None, TINY + ["--optimizer.weight_decay", "0.1"])
    model = create_model(cfg.model.model_config, 0)
    names = {id(p): n for n, p in model.named_parameters()}
    for g in param_groups(model.named_parameters(), cfg):
        for p in g["params"]:
            exempt = p.ndim < 2 or "norm" in names[id(p)]
            assert g["weight_decay"] == (0.0 if exempt else 0.1), names[id(p)]
    assert sum(len(g["params"]) for g in param_groups(model.named_parameters(), cfg)) == len(names)


def test_layer_decay_scales_lower_layers_down():
    cfg = load_config(None, TINY + ["--layer_decay", "0.5"])
    model = create_model(cfg.model.model_config, 0)
    opt = build_optimizer(model.named_parameters(), cfg)
    by_param = {id(p): g["lr_scale"] for g in opt.param_groups for p in g["params"]}
    scale = {n: by_param[id(p)] for n, p in model.named_parameters()}
    # L=3: embedding depth 0 -> 0.5^4, layer i -> 0.5^(3-i), head/final norm -> 1
    assert scale["embed_tokens.weight"] == 0.5**4
    assert [scale[f"layers.{i}.mlp.up_proj.weight"] for i in range(3)] == [0.5**3, 0.5**2, 0.5]
    assert scale["norm.weight"] == 1.0
    Schedule(opt, cfg, 10).apply(5)
    for g in opt.param_groups:
        assert g["lr"] == pytest.approx(Schedule(opt, cfg, 10).lr(5) * g["lr_scale"])
    assert isinstance(opt, torch.optim.AdamW)


# ---- the step's update without a host read (train/step.py) ---------------------------------------------------


def _trainer_parts(extra=()):
    from meshformer.parallel import init_parallel
    from meshformer.train.optim import Optimizers
    from meshformer.train.step import build_parts

    cfg = load_config(
        None, [*TINY, "--runner_wrapper.use_clip_grad", "true", "--runner_wrapper.max_grad_norm", "0.5", *extra]
    )
    env = init_parallel(cfg, world_size=1)
    parts = build_parts(cfg, env).parts
    return cfg, env, parts, Optimizers(parts.parts, cfg)


def _step(cfg, env, parts, opt, batch, poison=False):
    from meshformer.train.step import clip_threshold, train_step

    real = parts.forward_backward

    def poisoned(*a, **kw):  # gradients as an overflow or a bad sample leaves them
        out = real(*a, **kw)
        for p in parts.parameters():
            p.grad.fill_(math.nan)
        return out

    if poison:
        parts.forward_backward = poisoned
    try:
        return train_step(
            parts,
            opt,
            env,
            batch[:, :-1],
            batch[:, 1:],
            n_micro=1,
            ignore_index=-100,
            max_grad_norm=clip_threshold(cfg),
        )
    finally:
        if poison:
            del parts.forward_backward


def test_a_non_finite_step_is_skipped_on_the_device_exactly():
    """Fused AdamW skips a non-finite step on the device (found_inf): the run then equals, bit for bit, one that
    never saw that step (weights, both moments and Adam's step count), clipping included."""
    torch.manual_seed(0)
    batches = [torch.randint(0, 32, (4, 9)) for _ in range(3)]
    a, b = _trainer_parts(), _trainer_parts()
    assert a[3].skips_on_device(a[1].device)
    _step(*a, batches[0]), _step(*b, batches[0])
    skipped = _step(*a, batches[1], poison=True)
    assert skipped.skipped and not math.isfinite(skipped.grad_norm)
    _step(*a, batches[2]), _step(*b, batches[2])
    for (name, pa), pb in zip(a[2].parts[0].named_parameters(), b[2].parts[0].parameters()):
        assert torch.equal(pa, pb), name
    states_a, states_b = a[3].state_tensors(), b[3].state_tensors()
    assert len(states_a) == len(states_b) > 0 and all(torch.equal(x, y) for x, y in zip(states_a, states_b))


def test_no_host_read_between_backward_and_the_update(monkeypatch):
    """Nothing is read back from the device between the end of backward and the optimizer step (a GPU would sit
    idle while the host waits): the loss, the norm and the skip flag are read once, after the update is queued.
    With foreach AdamW (no device skip) the host decides, and reads first."""
    events = []
    real_item, real_float, real_bool = torch.Tensor.item, torch.Tensor.__float__, torch.Tensor.__bool__
    monkeypatch.setattr(torch.Tensor, "item", lambda t: events.append("read") or real_item(t))
    monkeypatch.setattr(torch.Tensor, "__float__", lambda t: events.append("read") or real_float(t))
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: events.append("read") or real_bool(t))
    real_step = torch.optim.AdamW.step
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, *a, **k: events.append("update") or real_step(self))
    for extra, device_skip in (((), True), (("--optimizer.fused", "false"), False)):
        cfg, env, parts, opt = _trainer_parts(extra)
        real_fb = parts.forward_backward

        def marked(*a, real_fb=real_fb, **k):
            out = real_fb(*a, **k)
            events.append("backward done")
            return out

        parts.forward_backward = marked
        events.clear()
        _step(cfg, env, parts, opt, torch.randint(0, 32, (4, 9)))
        between = events[events.index("backward done") + 1 : events.index("update")]
        assert ("read" not in between) == device_skip, (extra, events)
        assert "read" in events[events.index("update") :] or not device_skip
