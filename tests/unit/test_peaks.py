"""One table of accelerator peaks (backends/peaks.py): the trainer's MFU denominator on a recognised GPU is the
planner's figure for the same dtype, fp32 counted at the fp32 peak unless TF32 is on (an fp32 run's MFU was taken
against half the bf16 peak, 7x too high on an H100)."""

from __future__ import annotations

import pytest
import torch

from meshformer.backends import peaks
from meshformer.backends.peaks import PEAKS, peak_flops
from meshformer.planner.accelerators import ACCELERATORS

CUDA = torch.device("cuda")


@pytest.fixture
def h100(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    before = torch.get_float32_matmul_precision()
    yield ACCELERATORS["H100"]
    torch.set_float32_matmul_precision(before)


def test_an_fp32_run_on_an_h100_is_measured_against_the_planners_fp32_peak(h100):
    torch.set_float32_matmul_precision("highest")
    assert peak_flops(CUDA, torch.float32, 0) == (h100.peak_fp32, "datasheet:H100")
    assert peak_flops(CUDA, torch.bfloat16, 0) == (h100.peak_bf16, "datasheet:H100")
    assert h100.peak_fp32 == pytest.approx(66.9e12)


def test_tf32_on_counts_the_tensor_core_peak(h100):
    torch.set_float32_matmul_precision("high")
    assert peak_flops(CUDA, torch.float32, 0) == (PEAKS["H100"].tf32, "datasheet:H100 (TF32 on)")
    assert PEAKS["H100"].tf32 == pytest.approx(494.7e12)
    assert peak_flops(CUDA, torch.bfloat16, 0)[0] == h100.peak_bf16  # TF32 leaves bf16 alone


def test_every_planner_accelerator_reads_the_one_table():
    for name, acc in ACCELERATORS.items():
        assert (acc.peak_bf16, acc.peak_fp32) == (PEAKS[name].bf16, PEAKS[name].fp32), name


def test_a_configured_peak_wins(h100):
    assert peak_flops(CUDA, torch.float32, 1e12) == (1e12, "config")


# ---- the measured peak of a device without a data sheet (a CPU) -------------------------------------------------
CPU = torch.device("cpu")


class FakeMatmuls:
    """Stands in for the clock and the timed calls: a call of [m, k] x [k, n] takes flops / rate(m, k, n) seconds
    on a fake clock, so the measurement's choices are checked without timing anything."""

    def __init__(self, monkeypatch, rate):
        self.now, self.rate, self.calls = 0.0, rate, 0
        monkeypatch.setattr(peaks, "_clock", lambda: self.now)
        monkeypatch.setattr(peaks, "_call_seconds", self.call)
        peaks._measured_once.cache_clear()

    def call(self, fn, a, b, device):
        m, k = a.shape
        n = b.shape[0] if b.shape[1] == k else b.shape[1]  # x @ w.t() takes w [n, k]; a square is either
        seconds = 2 * m * k * n / self.rate(m, k, n)
        self.now += seconds
        self.calls += 1
        return seconds


def test_the_measured_peak_is_the_best_of_squares_and_tall_linear_shapes(monkeypatch):
    """A CPU whose fastest matmul is a tall linear shape (as bf16 on AMX): the peak is that shape's rate, at least
    every rate timed; squares alone would have missed it. fp32 times both libraries."""
    tall = [s for s in peaks.peak_shapes() if s.linear and s.m >= 2048 and s.m >= 4 * max(s.k, s.n)]
    assert tall, "the shapes timed must include tall ones: many rows, a layer's widths"
    assert [s.m for s in peaks.peak_shapes() if s.m == s.k == s.n and not s.linear] == list(peaks.SQUARE_SIDES)
    fake = FakeMatmuls(monkeypatch, lambda m, k, n: 1e12 * (2 if (m, k, n) == (8192, 512, 1536) else 1 + k / 8192))
    measured = peaks.measured_peak(CPU, torch.float32)
    labels = [label for label, _ in measured.rates]
    assert any("(x @ w.t())" in label for label in labels) and any("(x @ w.t())" not in label for label in labels)
    assert {label.rsplit(" ", 1)[1] for label in labels} == {"torch", "oneDNN"}
    assert measured.flops >= max(rate for _, rate in measured.rates)
    assert measured.flops in [rate for _, rate in measured.rates]
    assert measured.flops == pytest.approx(2e12) and measured.best.startswith("[8192, 512] x [512, 1536] (x @ w.t())")
    calls = fake.calls
    assert peak_flops(CPU, torch.float32, 0)[0] == measured.flops  # the trainer's figure, once per process
    assert fake.calls == calls


def test_the_measured_peak_stays_within_its_time_budget(monkeypatch):
    """A slow device (every call at 1 GFLOP/s): the timing stops before the budget is spent and before any call
    would take longer than MAX_CALL_S, leaving the large shapes out."""
    fake = FakeMatmuls(monkeypatch, lambda m, k, n: 1e9)
    measured = peaks.measure_matmul_peak(CPU, torch.bfloat16)
    assert fake.now <= peaks.BUDGET_S
    assert 0 < len(measured.rates) < len(peaks.peak_shapes())
    fast = FakeMatmuls(monkeypatch, lambda m, k, n: 1e13)
    timed = peaks.measure_matmul_peak(CPU, torch.bfloat16).rates
    assert fast.now <= peaks.BUDGET_S
    flops = {f"{s} torch": s.flops for s in peaks.peak_shapes()}
    assert max(flops[label] for label, _ in timed) / 1e13 <= peaks.MAX_CALL_S
    assert len(timed) < len(flops)  # the 8192 square (0.11 s a call here) was left out
