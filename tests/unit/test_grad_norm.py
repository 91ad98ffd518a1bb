"""The gradient norm of plain fp32 CPU gradients through BLAS's dot product (backends/cpu.py `sum_of_squares`),
against float64 and torch's own norm, and the trainer's parts taking that path."""

from __future__ import annotations

import pytest
import torch

from meshformer.backends import cpu
from meshformer.backends.cpu import sum_of_squares, sums_squares_by_dot
from meshformer.config import load_config
from meshformer.parallel import init_parallel
from meshformer.train.step import build_parts


def _tensors(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(512, 64), (64,), (1000, 3), (7,), (96, 96)]
    return [torch.randn(s, generator=g) * (10.0 ** (i - 2)) for i, s in enumerate(shapes)]  # magnitudes 1e-2..1e2


def test_sum_of_squares_equals_float64_within_fp32_rounding():
    ts = _tensors()
    exact = sum((t.double() ** 2).sum() for t in ts)
    ours = sum_of_squares(ts)
    assert ours.dtype == torch.float32 and ours.dim() == 0
    assert abs(ours.double() - exact) / exact < 1e-6
    theirs = torch.nn.utils.get_total_norm(ts, 2.0, False, True)
    assert abs(ours.sqrt() - theirs) / theirs < 1e-6


def test_only_plain_contiguous_fp32_cpu_tensors_take_it():
    ts = _tensors()
    assert sums_squares_by_dot(ts)
    assert not sums_squares_by_dot(ts + [torch.ones(4, dtype=torch.bfloat16)])  # its dot would round to bf16
    assert not sums_squares_by_dot(ts + [torch.ones(4, 6).t()])
    assert not sums_squares_by_dot(ts + [torch.ones(3, dtype=torch.float64)])


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_the_parts_norm_takes_the_dot_path_and_equals_torchs(compute_dtype, monkeypatch):
    """A one-process model's gradients (fp32 master weights in both numerics) go through `sum_of_squares`, and the
    norm equals torch.nn.utils.get_total_norm over the same gradients."""
    o = {
        "model.model_config.hidden_size": 64, "model.model_config.num_layers": 2, "model.model_config.num_heads": 4,
        "model.model_config.n_kv_heads": 2, "model.model_config.intermediate_size": 96,
        "model.model_config.vocab_size": 256, "model.model_config.seq_length": 16,
        "model.model_config.compute_dtype": compute_dtype, "model.model_config.param_init_type": "float32",
        "compile": False,
    }  # fmt: skip
    cfg = load_config(None, [s for k, v in o.items() for s in (f"--{k}", str(v))])
    env = init_parallel(cfg, world_size=1)
    parts = build_parts(cfg, env).parts
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(3))
    parts.forward_backward(tokens[:, :-1], tokens[:, 1:], n_micro=1, loss_scale=1.0)
    calls = []
    real = cpu.sum_of_squares
    monkeypatch.setattr("meshformer.parallel.parts.sum_of_squares", lambda ts: calls.append(len(ts)) or real(ts))
    grads = [p.grad for p in parts.parameters() if p.grad is not None]
    ours = parts.grad_norm()
    assert calls == [len(grads)]
    theirs = torch.nn.utils.get_total_norm(grads, 2.0, False, True)
    assert abs(ours - theirs) / theirs < 1e-6
