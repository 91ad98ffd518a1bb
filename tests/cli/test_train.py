"""End-to-end training on one process: loss falls, resume is exact, accumulation is equivalent, output is safe."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import tiny_overrides
from meshformer.config import load_config
from meshformer.errors import UserError
from meshformer.train.trainer import run_training


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def train(dataset, out, extra=None):
    cfg = load_config(None, tiny_overrides(dataset, out, extra))
    run_training(cfg)
    return metrics(out)


def test_thirty_steps_loss_falls_and_metrics_are_complete(tiny_dataset, tmp_path):
    recs = train(
        tiny_dataset,
        tmp_path / "run",
        {"runner_config.stop_step": 30, "eval_config.eval_interval": 10, "eval_config.eval_iters": 2},
    )
    assert [r["step"] for r in recs] == list(range(1, 31))
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "samples_per_s", "mfu", "peak_mem_bytes"):
        assert all(key in r for r in recs), key
    assert [r["step"] for r in recs if "eval_loss" in r] == [10, 20, 30]
    start = sum(r["loss"] for r in recs[:3]) / 3
    end = sum(r["loss"] for r in recs[-3:]) / 3
    assert end < start - 0.5, (start, end)  # ln(512)=6.2 at start; a working step drops it well below
    assert recs[-1]["eval_loss"] < recs[0]["loss"]
    assert (tmp_path / "run" / "checkpoint" / "step_00000030" / "trainer_state.json").is_file()


def test_resume_equals_uninterrupted_run_exactly(tiny_dataset, tmp_path):
    common = {"lr_schedule.total_steps": 10, "callbacks": "[{type: CheckpointMonitor, save_checkpoint_steps: 4}]"}
    full = train(tiny_dataset, tmp_path / "full", {**common, "runner_config.stop_step": 10})
    part = tmp_path / "part"
    train(tiny_dataset, part, {**common, "runner_config.stop_step": 6})  # checkpoints at 4 and 6 (the end)
    resumed = train(tiny_dataset, part, {**common, "runner_config.stop_step": 10, "resume_training": True})
    assert [r["step"] for r in resumed] == list(range(1, 11))
    for a, b in zip(full, resumed):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"] and a["lr"] == b["lr"], (a, b)


def test_gradient_accumulation_matches_larger_batch(tiny_dataset, tmp_path):
    big = train(tiny_dataset, tmp_path / "big", {"runner_config.stop_step": 4, "train_dataset.batch_size": 4})
    acc = train(
        tiny_dataset,
        tmp_path / "acc",
        {"runner_config.stop_step": 4, "train_dataset.batch_size": 2, "runner_config.gradient_accumulation_steps": 2},
    )
    for a, b in zip(big, acc):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)


def test_fresh_run_refuses_to_overwrite_existing_output(tiny_dataset, tmp_path):
    out = tmp_path / "run"
    train(tiny_dataset, out, {"runner_config.stop_step": 2})
    before = (out / "metrics.jsonl").read_text()
    with pytest.raises(UserError, match="output_dir"):
        train(tiny_dataset, out, {"runner_config.stop_step": 2})
    assert (out / "metrics.jsonl").read_text() == before
    assert (out / "checkpoint" / "step_00000002").is_dir()


def test_bf16_compute_trains_close_to_fp32(tiny_dataset, tmp_path):
    fp32 = train(tiny_dataset, tmp_path / "fp32", {"runner_config.stop_step": 3})
    bf16 = train(
        tiny_dataset, tmp_path / "bf16", {"runner_config.stop_step": 3, "model.model_config.compute_dtype": "bfloat16"}
    )
    # bf16 keeps ~3 significant digits; after 3 steps of a 6.2-nat loss the runs agree to about 1e-2.
    for a, b in zip(fp32, bf16):
        assert abs(a["loss"] - b["loss"]) < 2e-2 * a["loss"]
    assert any(a["loss"] != b["loss"] for a, b in zip(fp32, bf16)), "bf16 was not applied"


def test_cli_bad_dataset_dir_is_one_line_exit_2(tmp_path):
    cfg = tmp_path / "c.yaml"
    small = "model:\n  model_config: {num_layers: 2, hidden_size: 64, num_heads: 4, intermediate_size: 128}\n"
    cfg.write_text(small + "train_dataset:\n  data_loader:\n    dataset_dir: %s\n" % (tmp_path / "nope"))
    r = subprocess.run(
        [sys.executable, "-m", "meshformer", "train", str(cfg), "--output_dir", str(tmp_path / "o")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "dataset_dir" in r.stderr and "Traceback" not in r.stderr


def test_seed_section_33_yaml_trains_with_only_size_layout_warmup_steps_overridden(tiny_dataset, tmp_path):
    """The seed's skeleton, saved as written, with the README's overrides (data, size, degrees, warm-up, steps)."""
    from conftest import ROOT

    overrides = [
        "--train_dataset.data_loader.dataset_dir",
        str(tiny_dataset),
        "--model.model_config.hidden_size",
        "32",
        "--model.model_config.num_layers",
        "2",
        "--model.model_config.num_heads",
        "4",
        "--model.model_config.seq_length",
        "32",
        "--model.model_config.vocab_size",
        "512",
        "--parallel_config.data_parallel",
        "1",
        "--parallel_config.model_parallel",
        "1",
        "--parallel_config.pipeline_stage",
        "1",
        "--optimizer.warmup_steps",
        "2",
        "--runner_config.stop_step",
        "4",
        "--output_dir",
        str(tmp_path / "o"),
    ]
    cfg = load_config(ROOT / "configs" / "seed_pretrain_skeleton.yaml", overrides)
    assert cfg.train_dataset.batch_size == 4 and cfg.parallel_config.micro_batch_num == 8
    run_training(cfg)
    recs = metrics(tmp_path / "o")
    assert [r["step"] for r in recs] == [1, 2, 3, 4] and all(r["loss"] > 0 for r in recs)


def test_seven_b_config_is_the_seed_layout_and_batch():
    from conftest import ROOT
    from meshformer.config import validate_layout
    from meshformer.parallel.batch_plan import BatchPlan
    from meshformer.parallel.dims import ParallelDims

    cfg = load_config(ROOT / "configs" / "llama2_7b_pretrain_8card.yaml")
    validate_layout(cfg, 8)
    with pytest.raises(UserError, match="but 4 processes"):
        validate_layout(cfg, 4)
    plan = BatchPlan.from_config(cfg, ParallelDims(pp=2, dp_replicate=2, tp=2))
    assert plan.global_batch == 64 and plan.n_micro == 8  # seed 2.4: global batch 64
