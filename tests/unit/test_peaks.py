"""One table of accelerator peaks (backends/peaks.py): the trainer's MFU denominator on a recognised GPU is the
planner's figure for the same dtype, fp32 counted at the fp32 peak unless TF32 is on (an fp32 run's MFU was taken
against half the bf16 peak, 7x too high on an H100)."""

from __future__ import annotations

import pytest
import torch

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
