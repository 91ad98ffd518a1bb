"""Preemption and restarts: a signal saves and exits 0, `resume_training: auto`, workers die with their launcher."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import tiny_overrides
from meshformer.checkpoint import store
from meshformer.config import load_config
from meshformer.train.trainer import run_training

TOTAL = 400  # the schedule length: fixed, so a stopped-and-resumed run follows the same learning rates


def _metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.endswith("}")]


def _cli(dataset: Path, out: Path, steps: int, extra: dict | None = None) -> list[str]:
    args = tiny_overrides(
        dataset, out, {"runner_config.stop_step": steps, "lr_schedule.total_steps": TOTAL, **(extra or {})}
    )
    return [sys.executable, "-m", "meshformer", "train", str(Path(__file__).parents[1] / "empty.yaml"), *args]


def _wait_for_steps(proc: subprocess.Popen, out: Path, n: int, timeout: float = 120) -> None:
    t0 = time.time()
    while len(_metrics(out)) < n:
        assert proc.poll() is None, proc.communicate()
        assert time.time() - t0 < timeout, "training did not start"
        time.sleep(0.05)


def test_sigterm_saves_at_the_next_step_and_exits_0_then_resume_matches(tiny_dataset, tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        _cli(tiny_dataset, out, TOTAL), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    _wait_for_steps(proc, out, 3)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-2000:]
    assert "SIGTERM: stopping after step" in stdout
    stopped = len(_metrics(out))
    assert 3 <= stopped < TOTAL
    assert [p.name for p in store.list_checkpoints(out)] == [f"step_{stopped:08d}"]
    # Resume to three steps past the stop; an uninterrupted run of the same length gives the same numbers.
    run_training(
        load_config(
            None,
            tiny_overrides(
                tiny_dataset,
                out,
                {"runner_config.stop_step": stopped + 3, "lr_schedule.total_steps": TOTAL, "resume_training": True},
            ),
        )
    )
    ref = tmp_path / "ref"
    run_training(
        load_config(
            None,
            tiny_overrides(
                tiny_dataset, ref, {"runner_config.stop_step": stopped + 3, "lr_schedule.total_steps": TOTAL}
            ),
        )
    )
    key = lambda recs: [(r["step"], r["loss"], r["grad_norm"]) for r in recs]  # noqa: E731
    assert key(_metrics(out)) == key(_metrics(ref))


def test_resume_auto_starts_fresh_then_resumes(tiny_dataset, tmp_path, capsys):
    out = tmp_path / "run"
    auto = {"resume_training": "auto", "lr_schedule.total_steps": TOTAL}
    run_training(load_config(None, tiny_overrides(tiny_dataset, out, {"runner_config.stop_step": 2, **auto})))
    assert "no checkpoint in" in capsys.readouterr().out
    run_training(load_config(None, tiny_overrides(tiny_dataset, out, {"runner_config.stop_step": 4, **auto})))
    assert "at step 2" in capsys.readouterr().out
    assert [r["step"] for r in _metrics(out)] == [1, 2, 3, 4]
    # An attempt that died before its first checkpoint left metrics only: auto starts over (no refusal).
    store.checkpoint_root(out).rename(tmp_path / "moved")
    run_training(load_config(None, tiny_overrides(tiny_dataset, out, {"runner_config.stop_step": 1, **auto})))
    assert [r["step"] for r in _metrics(out)] == [1]


def _alive_with(marker: str) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if marker in cmd and int(d.name) != os.getpid():
                pids.append(int(d.name))
    return pids


def test_killing_torchrun_takes_its_workers_with_it(tiny_dataset, tmp_path):
    out = tmp_path / "killed_launcher_run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    # 4 workers: without the death signal every one of them outlives a SIGKILLed launcher, so the test would fail.
    args = _cli(tiny_dataset, out, TOTAL, {"parallel_config.data_parallel": 4})[3:]  # after "-m meshformer"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "4",
        "-m",
        "meshformer",
        *args,
    ]
    launcher = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        _wait_for_steps(launcher, out, 2)
        workers = [p for p in _alive_with(str(out)) if p != launcher.pid]
        assert len(workers) >= 4
        launcher.kill()
        launcher.wait()
        deadline = time.time() + 10
        while _alive_with(str(out)) and time.time() < deadline:
            time.sleep(0.2)
        assert _alive_with(str(out)) == []
    finally:
        for pid in _alive_with(str(out)):
            os.kill(pid, signal.SIGKILL)
