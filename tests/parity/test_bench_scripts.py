"""The benchmark scripts run on a CPU with tiny models, so that they cannot rot between the machines they are for.

bench/gpu_train.py is the GPU benchmark (one device, or torchrun over eight); here it trains a tiny preset on the
CPU in every recompute mode, and under torchrun with FSDP, and its measured activations must match the planner's
prediction it prints beside them. bench/bench_vs_hf.py trains a tiny Llama on both sides and must show the same
losses as transformers.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT, TORCHRUN

ACTIVATIONS_RTOL = 0.10  # as tests/cli/test_memory.py
TINY = ["--preset", "tiny", "--seq", "64", "--batch", "2", "--steps", "2", "--warmup", "1"]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}


def _run(cmd: list[str]) -> str:
    """Run a bench script; its stdout, once it exited 0."""
    p = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _check_row(row: dict, world: int) -> None:
    assert "error" not in row, row
    assert row["world"] == world and row["tokens_per_s_per_device"] > 0 and 0 < row["mfu"] < 1
    assert math.isfinite(row["loss_first"]) and math.isfinite(row["loss_last"])
    got, want = row["activations_bytes"], row["predicted_activations_bytes"]
    assert abs(want - got) <= ACTIVATIONS_RTOL * got, (row["mode"], want, got)


def test_gpu_bench_trains_the_tiny_preset_on_the_cpu_in_every_recompute_mode(tmp_path):
    out = tmp_path / "rows.jsonl"
    modes = "none,selective,full"
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_train.py"), *TINY, "--modes", modes, "--json", str(out)]
    out_text = _run(cmd)
    rows = _rows(out)
    assert [r["mode"] for r in rows] == modes.split(",")
    for row in rows:
        _check_row(row, 1)
    assert "| tiny | 4 | 64 x 2 | full |" in out_text  # the table a user reads


def test_gpu_bench_trains_the_tiny_preset_as_qlora(tmp_path):
    out = tmp_path / "rows.jsonl"
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_train.py"), *TINY, "--qlora", "--modes", "full"]
    _run([*cmd, "--json", str(out)])
    (row,) = _rows(out)
    assert row["qlora"] is True
    _check_row(row, 1)
    assert row["params_bytes"] == row["predicted_params_bytes"]  # the NF4 base counted exactly


def test_gpu_bench_under_torchrun_shards_with_fsdp(tmp_path):
    out = tmp_path / "rows.jsonl"
    script = str(ROOT / "bench" / "gpu_train.py")
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", script, *TINY, "--fsdp", "--modes", "full"]
    _run([*cmd, "--json", str(out)])
    (row,) = _rows(out)
    assert row["fsdp"] is True
    _check_row(row, 2)


@pytest.mark.filterwarnings("ignore")
def test_bench_vs_hf_trains_both_sides_to_the_same_losses():
    pytest.importorskip("transformers")
    shape = ["--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "128", "--vocab", "256"]
    run = ["--seq", "32", "--batch", "2", "--steps", "2", "--warmup", "1", "--peak-flops", "1e11"]
    cmd = [sys.executable, str(ROOT / "bench" / "bench_vs_hf.py"), *shape, *run]
    out_text = _run(cmd)
    worst = re.search(r"max \|diff\| over all (\d+) steps: (\S+)", out_text)
    assert worst and int(worst[1]) == 3 and float(worst[2]) <= 1e-5, out_text[-2000:]
    assert re.search(r"ratio meshformer / HF: \d+\.\d+x", out_text)


def test_recompute_bench_measures_what_the_planner_predicts_in_bf16():
    shape = ["--hidden", "64", "--layers", "2", "--seq", "32", "--batch", "2", "--steps", "1", "--dtype", "bfloat16"]
    cmd = [sys.executable, str(ROOT / "bench" / "recompute.py"), *shape]
    out_text = _run(cmd)
    rows = re.findall(r"^\| (none|full|selective) \| ([\d.]+) MiB \| ([\d.]+) MiB \|", out_text, re.M)
    assert [r[0] for r in rows] == ["none", "full", "selective"], out_text
    for mode, measured, predicted in rows:
        assert abs(float(predicted) - float(measured)) <= ACTIVATIONS_RTOL * float(measured), (mode, out_text)


def test_ab_config_times_variants_alternating_in_one_process():
    shape = ["--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "128", "--vocab", "256"]
    run = ["--seq", "32", "--batch", "2", "--steps", "2", "--warmup", "1"]
    variants = ["", "recompute_config.recompute=true"]
    cmd = [sys.executable, str(ROOT / "bench" / "ab_config.py"), *shape, *run, "--", *variants]
    out_text = _run(cmd)
    rows = re.findall(r"^  (\S+)\s+median ([\d.]+) s \(([+-][\d.]+)%\).*last loss ([\d.]+)$", out_text, re.M)
    assert [r[0] for r in rows] == ["(defaults)", variants[1]], out_text
    assert float(rows[0][2]) == 0.0
    assert abs(float(rows[0][3]) - float(rows[1][3])) < 1e-4  # recompute changes the memory, not the numbers


def test_moe_bench_trains_grouped_and_looped_experts_to_the_same_losses(tmp_path):
    """bench/moe.py on a tiny Qwen3-MoE: both expert modes train, from the same weights and data to the same
    losses, with MFU against active FLOPs (the planner's count)."""
    out = tmp_path / "rows.jsonl"
    cmd = [sys.executable, str(ROOT / "bench" / "moe.py"), "--preset", "tiny", "--seq", "64", "--batch", "2"]
    out_text = _run([*cmd, "--steps", "2", "--warmup", "1", "--dtype", "float32", "--json", str(out)])
    grouped, loop = _rows(out)
    assert (grouped["experts"], loop["experts"]) == ("grouped", "loop")
    for row in (grouped, loop):
        assert "error" not in row, row
        assert row["active_params"] < row["total_params"] and row["tokens_per_s"] > 0 and 0 < row["mfu"] < 1
        assert row["mfu"] == pytest.approx(row["flops_per_token"] * row["tokens_per_s"] / row["peak_flops"])
    for key in ("loss_first", "loss_last"):
        assert grouped[key] == pytest.approx(loop[key], rel=1e-5)
    assert "| tiny | 2 | 64 x 2 | float32 | grouped |" in out_text and "grouped / loop tokens/s:" in out_text
    layer = tmp_path / "layer.jsonl"
    _run([*cmd, "--steps", "2", "--warmup", "0", "--dtype", "float32", "--layer-only", "--json", str(layer)])
    rows = _rows(layer)
    assert [r["experts"] for r in rows] == ["grouped", "loop"]
    assert all(r["rows"] == 2 * 64 * 2 and r["best_s"] > 0 and r["tflop_per_s"] > 0 for r in rows)


def test_gpu_bench_trains_the_tiny_preset_with_fp8_linears_on_the_cpu(tmp_path):
    """`--fp8` so the GPU benchmark's FP8 path cannot rot: every decoder linear of the tiny preset converts (its
    widths are multiples of 16), it trains to finite losses, and the table says FP8."""
    out = tmp_path / "rows.jsonl"
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_train.py"), *TINY, "--modes", "selective", "--fp8", "tensorwise"]
    out_text = _run([*cmd, "--json", str(out)])
    (row,) = _rows(out)
    assert "error" not in row, row
    assert row["fp8"] == "tensorwise" and row["fp8_note"] == "fp8: 28 decoder linears in FP8 (tensorwise)"
    assert math.isfinite(row["loss_first"]) and math.isfinite(row["loss_last"]) and row["tokens_per_s_per_device"] > 0
    assert "| tiny | 4 | 64 x 2 | selective fp8 tensorwise |" in out_text
