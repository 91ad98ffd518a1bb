"""Machines die: SIGKILL at random moments (inside saves too), restarts under torchrun, a changed layout.

Every interrupted run is resumed with `resume_training: auto` until it completes; its metrics must then equal an
uninterrupted run's bit for bit (fp32, CPU): the checkpoint holds everything the continuation depends on, and a
half-written save is never picked.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import tiny_overrides

STEPS = 80  # long enough that 20 kills, each after at least one new step, land before the end
EVERY_STEP = "[{type: MFLossMonitor, per_print_times: 100}, {type: CheckpointMonitor, save_checkpoint_steps: 1, keep_checkpoint_max: 2}]"  # noqa: E501
ASYNC_EVERY_STEP = EVERY_STEP.replace("keep_checkpoint_max: 2", "keep_checkpoint_max: 2, async_save: true")
# The runs that are not killed (the references, a killed run's last attempt) save only every SAVED_AT steps and
# keep those checkpoints (a checkpoint per step costs more than the step; saving must not change what training
# computes); test_a_checkpoint_resumes_under_other_layouts starts from the dp2xtp2 reference's step SAVED_AT.
SAVED_AT = 6
EVERY_SIXTH_STEP = f"[{{type: MFLossMonitor, per_print_times: 100}}, {{type: CheckpointMonitor, save_checkpoint_steps: {SAVED_AT}, keep_checkpoint_max: {STEPS}}}]"  # noqa: E501
EMPTY = str(Path(__file__).parents[1] / "empty.yaml")


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("WORLD_SIZE", None)
    return env


def _cmd(dataset: Path, out: Path, nproc: int, extra: dict) -> list[str]:
    args = tiny_overrides(
        dataset,
        out,
        {
            "runner_config.stop_step": STEPS,
            "lr_schedule.total_steps": STEPS,
            "resume_training": "auto",
            "callbacks": EVERY_STEP,
            **extra,
        },
    )
    if nproc == 1:
        return [sys.executable, "-m", "meshformer", "train", EMPTY, *args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "-m",
        "meshformer",
        "train",
        EMPTY,
        *args,
    ]


def _metrics(out: Path) -> list[tuple]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    recs = [json.loads(ln) for ln in path.read_text().splitlines() if ln.endswith("}")]
    return [(r["step"], r["loss"], r["grad_norm"], r.get("eval_loss")) for r in recs]


def _lines_logged(out: Path) -> int:
    """How many whole lines metrics.jsonl holds (polled every few ms while a job runs: no JSON parsing)."""
    try:
        return (out / "metrics.jsonl").read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def _wait_for_a_save(out: Path, proc: subprocess.Popen, timeout: float = 30) -> bool:
    """Wait until a checkpoint is being written (a `step_N.tmp` directory exists); whether one was seen."""
    t0 = time.time()
    while proc.poll() is None and time.time() - t0 < timeout:
        if any((out / "checkpoint").glob("*.tmp")):
            return True
        time.sleep(0.002)
    return False


def _run_with_kills(
    dataset: Path, out: Path, nproc: int, extra: dict, kills: int, seed: int, aim_every: int = 0
) -> dict:
    """Start, SIGKILL the whole job at a random moment after training began, resume; `kills` times, then finish
    (that last attempt saving every SAVED_AT steps).

    Attempts alternate between in-line and background (async_save) checkpoint writes. With `aim_every` = n, every
    n-th attempt is killed while a checkpoint is being written (a few ms after its `.tmp` directory appears)."""
    rng = random.Random(seed)
    stats = {"kills": 0, "inside_save": 0, "attempts": 0, "async_kills": 0, "aimed": 0}
    while True:
        stats["attempts"] += 1
        assert stats["attempts"] < kills + 10, "the run does not complete"
        before = _lines_logged(out)
        in_background = stats["attempts"] % 2 == 0
        if stats["kills"] >= kills:  # the last attempt, which runs to the end
            callbacks = {"callbacks": EVERY_SIXTH_STEP}
        else:
            callbacks = {"callbacks": ASYNC_EVERY_STEP} if in_background else {}
        proc = subprocess.Popen(
            _cmd(dataset, out, nproc, {**extra, **callbacks}),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=_env(),
            start_new_session=True,
        )
        if stats["kills"] >= kills:
            _, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err[-3000:]
            return stats
        t0 = time.time()
        while _lines_logged(out) <= before and proc.poll() is None and time.time() - t0 < 120:
            time.sleep(0.01)
        if aim_every and stats["attempts"] % aim_every == 0 and _wait_for_a_save(out, proc):
            stats["aimed"] += 1
            time.sleep(rng.uniform(0.0, 0.02))  # somewhere inside the write: shards, metadata or the rename
        else:
            time.sleep(rng.uniform(0.0, 0.15 * nproc))  # a random point a few steps and saves in
        if proc.poll() is None:
            stats["inside_save"] += any((out / "checkpoint").glob("*.tmp"))
            os.killpg(proc.pid, signal.SIGKILL)
            stats["kills"] += 1
            stats["async_kills"] += in_background
        proc.wait()
        if proc.returncode == 0 and stats["kills"] < kills and len(_metrics(out)) == STEPS:
            return stats  # finished before the kill landed


@pytest.fixture(scope="module")
def references(tiny_dataset, tmp_path_factory) -> dict:
    """Each layout's uninterrupted run: its metrics (`name`), metrics.jsonl's records and its output directory."""
    refs = {}
    for name, nproc, extra in (("single", 1, {}), ("dp2xtp2", 4, LAYOUT)):
        out = tmp_path_factory.mktemp(name) / "run"
        cmd = _cmd(tiny_dataset, out, nproc, {**extra, "callbacks": EVERY_SIXTH_STEP})
        r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        refs[name], refs[f"{name}_dir"] = _metrics(out), out
        refs[f"{name}_records"] = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
        assert len(refs[name]) == STEPS
    return refs


def test_a_parallel_run_reports_the_time_its_logging_steps_spent_in_collectives(references):
    for name in ("single", "dp2xtp2"):
        logged = [r for r in references[f"{name}_records"] if "time_comm_s" in r]
        assert logged and logged[-1]["step"] == STEPS  # the last step is a logging step
        for r in logged:
            assert 0 <= r["time_comm_s"] <= r["step_time_s"], r
    # one process has nothing to communicate; four wait on all-reduces of tp and dp every step
    assert all(r["time_comm_s"] == 0 for r in references["single_records"] if "time_comm_s" in r)
    assert all(r["time_comm_s"] > 0 for r in references["dp2xtp2_records"] if "time_comm_s" in r)


LAYOUT = {"parallel_config.data_parallel": 2, "parallel_config.model_parallel": 2}


def test_sigkill_at_twenty_random_moments_then_resume_equals_uninterrupted(tiny_dataset, tmp_path, references):
    out = tmp_path / "run"
    stats = _run_with_kills(tiny_dataset, out, 1, {}, kills=20, seed=0)
    print(f"single process: {stats}")
    assert stats["kills"] >= 15 and stats["async_kills"] >= 5
    assert _metrics(out) == references["single"]


def test_sigkill_dp2xtp2_then_resume_equals_uninterrupted(tiny_dataset, tmp_path, references):
    """Four ranks writing one checkpoint (DCP shards, then rank 0's rename): ten whole-job kills, every other one
    with background writes and every third one aimed inside a write; the moments in between, at random, are what
    the single-process test samples twenty of (each attempt here costs four processes' start-up)."""
    out = tmp_path / "run"
    stats = _run_with_kills(tiny_dataset, out, 4, LAYOUT, kills=10, seed=1, aim_every=3)
    print(f"dp2xtp2: {stats}")
    assert stats["kills"] >= 8 and stats["async_kills"] >= 3 and stats["aimed"] >= 2
    assert stats["inside_save"] >= 2  # a half-written step_N.tmp was there at the kill, and was never picked
    assert _metrics(out) == references["dp2xtp2"]


def _close(a: list[tuple], b: list[tuple], rtol: float = 1e-6) -> bool:
    return len(a) == len(b) and all(
        x[0] == y[0] and all(abs(u - v) <= rtol * max(abs(v), 1e-12) for u, v in zip(x[1:3], y[1:3]))
        for x, y in zip(a, b)
    )


# (name, processes, overrides): each has global batch 8, as the dp2xtp2 run (micro batch 4 x dp 2)
LAYOUTS = [
    (
        "dp2xtp2xpp2",
        8,
        {
            **LAYOUT,
            "parallel_config.pipeline_stage": 2,
            "parallel_config.micro_batch_num": 2,
            "train_dataset.batch_size": 2,
        },
    ),
    ("pp2", 2, {"parallel_config.pipeline_stage": 2, "parallel_config.micro_batch_num": 2}),
    ("single", 1, {"runner_config.gradient_accumulation_steps": 2}),
]


def test_a_checkpoint_resumes_under_other_layouts(tiny_dataset, tmp_path, references):
    import shutil

    saved = tmp_path / "dp2xtp2"  # the uninterrupted dp2xtp2 run as it was after step SAVED_AT
    shutil.copytree(references["dp2xtp2_dir"], saved)
    for later in (saved / "checkpoint").glob("step_*"):
        if later.name != f"step_{SAVED_AT:08d}":
            shutil.rmtree(later)
    # six steps on: rounding differs by layout and grows with steps
    continuation = references["dp2xtp2"][SAVED_AT : 2 * SAVED_AT]
    for name, nproc, extra in LAYOUTS:
        out = tmp_path / name
        shutil.copytree(saved, out)
        r = subprocess.run(
            _cmd(tiny_dataset, out, nproc, {**extra, "resume_training": True, "runner_config.stop_step": 2 * SAVED_AT}),
            capture_output=True,
            text=True,
            env=_env(),
            timeout=300,
        )
        assert r.returncode == 0, (name, r.stderr[-3000:])
        got = _metrics(out)[SAVED_AT:]
        worst = max(abs(u - v) / abs(v) for x, y in zip(got, continuation) for u, v in zip(x[1:3], y[1:3]))
        print(f"{name}: steps 7-12 within {worst:.1e} of dp2xtp2")
        assert _close(got, continuation), (name, got, continuation)


def test_torchrun_restarts_a_job_that_lost_a_rank_and_it_finishes_like_an_uninterrupted_one(tiny_dataset, tmp_path):
    dp2 = {"parallel_config.data_parallel": 2}
    ref = tmp_path / "ref"
    uninterrupted = _cmd(tiny_dataset, ref, 2, {**dp2, "callbacks": EVERY_SIXTH_STEP})
    r = subprocess.run(uninterrupted, capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "run"
    cmd = _cmd(tiny_dataset, out, 2, {**dp2, "runner_config.stop_step": STEPS})
    cmd.insert(cmd.index("--standalone"), "--max-restarts=1")
    log = tmp_path / "torchrun.log"  # a file, not a pipe: an undrained pipe fills up and blocks the job
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=_env())
    t0 = time.time()
    while _lines_logged(out) < 4 and time.time() - t0 < 120:
        assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.01)
    victim = _worker_pids(str(out))[-1]
    os.kill(victim, signal.SIGKILL)  # one rank dies; torchrun restarts the group; `auto` resumes it
    proc.wait(timeout=300)
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    assert "resumed from" in text and "failed (exitcode: -9)" in text  # the lost rank, then the resumed attempt
    assert _metrics(out) == _metrics(ref)


def _worker_pids(marker: str) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        text = b" ".join(cmd).decode(errors="replace")
        if marker in text and "torch.distributed.run" not in text:
            pids.append(int(d.name))
    return sorted(pids)


@pytest.mark.parametrize(
    "fault, named",
    [
        ("die", r"rank 1 \(pid \d+ on .*\) died"),
        ("stop", r"rank 1 \(pid \d+ on .*\) is stopped .*SIGSTOP"),
        ("hang", r"rank 1 \(pid \d+ on .*\) is alive but hung"),
    ],
)
def test_a_dead_stopped_or_hung_rank_is_named_in_meshformers_own_message(tiny_dataset, tmp_path, fault, named):
    out = tmp_path / "run"
    args = tiny_overrides(
        tiny_dataset, out, {"parallel_config.data_parallel": 2, "comm_timeout": 8, "runner_config.stop_step": 1000}
    )
    hook = Path(__file__).parents[1] / "dist" / "fault_rank.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    log = tmp_path / "torchrun.log"
    proc = subprocess.Popen(
        [*cmd, str(hook), fault, "train", EMPTY, *args],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=_env(),
        start_new_session=True,
    )
    t0 = time.time()
    try:  # rank 0's line comes after comm_timeout at most (8 s); a frozen rank 1 then waits for torchrun's SIGKILL
        while "meshformer: error:" not in log.read_text() and proc.poll() is None and time.time() - t0 < 120:
            time.sleep(0.1)
        took = time.time() - t0
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    line = next((ln for ln in log.read_text().splitlines() if ln.startswith("meshformer: error:")), "")
    print(f"{fault}: {took:.1f} s: {line}")
    assert re.search(named, line), log.read_text()[-3000:]
    assert re.search(r"Rank 0 \(after step [1-9]\d*\) saw: RuntimeError", line) and "Traceback" not in line
