"""Observability: the step-time breakdown, the profiler window, TensorBoard, plots, the journal and compare."""

from __future__ import annotations

import json
import struct
import time

import pytest

from conftest import ROOT, tiny_overrides
from meshformer.cli.main import main
from meshformer.config import load_config
from meshformer.train.data import TrainingData
from meshformer.train.trainer import run_training

EMPTY = str(ROOT / "tests" / "empty.yaml")
PHASES = ("time_data_s", "time_fwd_bwd_s", "time_optim_s", "time_other_s")


def train(dataset, out, extra=None):
    cfg = load_config(None, tiny_overrides(dataset, out, {"runner_config.stop_step": 6, **(extra or {})}))
    run_training(cfg)
    return [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]


def data_share(recs):
    return sum(r["time_data_s"] for r in recs[1:]) / sum(r["step_time_s"] for r in recs[1:])


def test_the_breakdown_adds_up_and_a_slow_loader_shows_in_the_data_share(tiny_dataset, tmp_path, monkeypatch):
    normal = train(tiny_dataset, tmp_path / "normal")
    for r in normal:
        parts = sum(r[p] for p in PHASES)
        assert abs(parts - r["step_time_s"]) <= 0.05 * r["step_time_s"], r
        assert r["time_fwd_bwd_s"] > 0 and r["time_optim_s"] > 0
        # measured phases, not a remainder dressed up: the rest is the small bookkeeping between them
        assert r["time_other_s"] < 0.5 * r["step_time_s"], r
    fetch = TrainingData.train_batch

    def slow(self, *args):  # the test hook: a data loader 50 ms slower per step
        time.sleep(0.05)
        return fetch(self, *args)

    monkeypatch.setattr(TrainingData, "train_batch", slow)
    slowed = train(tiny_dataset, tmp_path / "slow")
    assert all(r["time_data_s"] >= 0.05 for r in slowed)
    assert data_share(slowed) > 0.5 and data_share(slowed) > 3 * data_share(normal), (data_share(normal), slowed)


def _png_size(path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def test_tensorboard_plot_journal_and_compare(tiny_dataset, tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    exp = tmp_path / "exp"
    tb = tmp_path / "tb"
    a = train(tiny_dataset, exp / "a", {"tensorboard.tensorboard_dir": str(tb), "eval_config.eval_interval": 3})
    events = EventAccumulator(str(tb))
    events.Reload()
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "time_fwd_bwd_s", "eval_loss"):
        got = [(e.step, e.value) for e in events.Scalars(key)]
        want = [(r["step"], r[key]) for r in a if key in r]
        assert [s for s, _ in got] == [s for s, _ in want], key
        assert all(abs(g - w) <= 1e-6 * max(1.0, abs(w)) for (_, g), (_, w) in zip(got, want)), key  # float32

    train(tiny_dataset, exp / "b", {"optimizer.learning_rate": 1e-3})
    lines = [json.loads(ln) for ln in (exp / "journal.jsonl").read_text().splitlines()]
    assert [ln["output_dir"] for ln in lines] == [str(exp / "a"), str(exp / "b")]
    assert lines[0]["changes"] == {}
    changes = lines[1]["changes"]
    assert changes["optimizer.learning_rate"] == [3e-3, 1e-3]
    assert "tensorboard.tensorboard_dir" in changes and "output_dir" not in changes
    assert (
        lines[1]["steps"] == 6
        and lines[1]["tokens_per_s"] > 0
        and lines[1]["loss"]
        == pytest.approx(json.loads((exp / "b" / "metrics.jsonl").read_text().splitlines()[-1])["loss"])
    )

    capsys.readouterr()
    assert main(["journal", str(exp)]) == 0
    table = capsys.readouterr().out
    assert "optimizer.learning_rate: 0.003 -> 0.001" in table and "(first run)" in table

    assert main(["compare", str(exp / "a"), str(exp / "b"), "--json"]) == 0
    diff = json.loads(capsys.readouterr().out)
    assert diff["config"]["optimizer.learning_rate"] == [3e-3, 1e-3]
    assert diff["metrics"]["loss"]["a"] == lines[0]["loss"] and diff["metrics"]["loss"]["b"] == lines[1]["loss"]
    assert main(["compare", str(exp / "a"), str(exp / "b")]) == 0
    assert "optimizer.learning_rate" in capsys.readouterr().out

    png = tmp_path / "curves.png"
    assert (
        main(["plot", str(exp / "a"), str(exp / "b"), "--output", str(png), "--width", "1200", "--height", "800"]) == 0
    )
    assert _png_size(png) == (1200, 800)
    assert main(["plot", str(tmp_path / "nothing"), "--output", str(png)]) == 2  # not a run: one line, exit 2


def test_profile_window_writes_a_trace_and_a_top_ops_table(tiny_dataset, tmp_path, capsys):
    out = tmp_path / "run"
    args = tiny_overrides(tiny_dataset, out, {"runner_config.stop_step": 4})
    assert main(["train", EMPTY, *args, "--profile", "2:3"]) == 0  # the command's own option after the overrides
    trace = json.loads((out / "profile" / "trace_rank0.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "meshformer_step" in names and any(str(n).startswith("aten::mm") for n in names)
    assert sum(n == "meshformer_step" for n in (e.get("name") for e in trace["traceEvents"])) == 2  # steps 2, 3
    assert "Self CPU" in (out / "profile" / "top_ops_rank0.txt").read_text()
    capsys.readouterr()
    assert main(["train", EMPTY, "--profile", "3:2", *args]) == 2
    assert "--profile '3:2'" in capsys.readouterr().err
