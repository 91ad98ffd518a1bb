"""The launcher owns its workers, and stop signals are honoured in every phase.

`meshformer launch` forwards SIGTERM to its workers (they save, everyone exits 0), takes them with it when it is
SIGKILLed, and reports a worker's bad input once, exit 2, without torchrun's traceback. A stop signal is seen
the moment it arrives even while the main thread is inside a long C call (os.system: glibc retries its wait on
EINTR, so no Python handler runs until it returns): the grace timer runs, a second signal exits at once, and
before the first step it ends the command with exit 0."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from conftest import ROOT, checksums, tiny_overrides, torchrun_env

TOTAL = 400
EMPTY = Path(__file__).parents[1] / "empty.yaml"


def _metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.endswith("}")]


def _alive_with(marker: str) -> list[int]:
    """Processes (but zombies and this one) whose command line names marker: the launcher and its workers."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if marker in cmd and state != "Z":
            pids.append(int(d.name))
    return pids


def _launch(dataset: Path, out: Path, extra: dict | None = None) -> subprocess.Popen:
    args = tiny_overrides(
        dataset,
        out,
        {
            "runner_config.stop_step": TOTAL,
            "lr_schedule.total_steps": TOTAL,
            "parallel_config.data_parallel": 2,
            **(extra or {}),
        },
    )
    cmd = [sys.executable, "-m", "meshformer", "launch", "--nproc", "2", str(EMPTY), *args]
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=torchrun_env(),
        start_new_session=True,  # its own session: nothing reaches it but what the test sends
    )


def _wait_for_steps(proc: subprocess.Popen, out: Path, n: int, timeout: float = 240) -> None:
    t0 = time.time()
    while len(_metrics(out)) < n:
        assert proc.poll() is None, proc.communicate()
        assert time.time() - t0 < timeout, "training did not start"
        time.sleep(0.1)


def _reap(marker: str) -> None:
    for pid in _alive_with(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_sigterm_saves_and_exits_0_then_the_resumed_launch_dies_whole_on_sigkill(tiny_dataset, tmp_path):
    out = tmp_path / "launched_run"
    try:
        launch = _launch(tiny_dataset, out)
        _wait_for_steps(launch, out, 2)
        launch.send_signal(signal.SIGTERM)
        stdout, stderr = launch.communicate(timeout=240)
        assert launch.returncode == 0, stderr[-3000:]
        assert "SIGTERM: stopping after step" in stdout and "Traceback" not in stderr, stderr[-3000:]
        stopped = len(_metrics(out))
        assert 2 <= stopped < TOTAL
        ckpt = out / "checkpoint" / f"step_{stopped:08d}"
        assert sorted(p.name for p in (out / "checkpoint").iterdir()) == [ckpt.name]
        assert _alive_with(str(out)) == []
        with (out / ".lock").open("a") as f:  # freed: a new run may take it
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(f, fcntl.LOCK_UN)
        saved = checksums(ckpt)

        # The resumed launch continues at the next step; SIGKILL of the launcher then leaves no process behind.
        launch = _launch(tiny_dataset, out, {"resume_training": "true"})
        _wait_for_steps(launch, out, stopped + 2)
        assert [r["step"] for r in _metrics(out)][: stopped + 2] == list(range(1, stopped + 3))
        assert len(_alive_with(str(out))) >= 3  # the launcher and both workers
        launch.kill()
        launch.communicate(timeout=60)
        deadline = time.time() + 10
        while _alive_with(str(out)) and time.time() < deadline:
            time.sleep(0.2)
        assert _alive_with(str(out)) == []
        assert checksums(ckpt) == saved  # the checkpoint it resumed from is untouched
    finally:
        _reap(str(out))


def test_a_bad_input_found_by_the_workers_is_one_line_exit_2(tiny_dataset, tmp_path):
    out = tmp_path / "bad_input_run"
    missing = tmp_path / "no_such_dataset"  # accepted by the launcher's checks; the workers fail to open it
    launch = _launch(tiny_dataset, out, {"train_dataset.data_loader.dataset_dir": missing})
    try:
        _, stderr = launch.communicate(timeout=240)
    finally:
        _reap(str(out))
    lines = stderr.strip().splitlines()
    assert launch.returncode == 2, stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("meshformer: error: train_dataset.data_loader.dataset_dir")
    assert str(missing) in lines[0] and "preprocess" in lines[0]


# ---- stop signals while the main thread is in a long C call ------------------------------------------------

STUCK = """
import os, sys
from meshformer.train.preemption import StopBeforeTraining, StopRequests, StoppedBeforeTraining
guard = StopRequests(GRACE) if sys.argv[1] == "loop" else StopBeforeTraining()
try:
    with guard:
        print("ready", flush=True)
        os.system("exec sleep 60 </dev/null >/dev/null 2>&1")  # one C call for a minute: no Python handler runs
    print("returned", flush=True)
except StoppedBeforeTraining as e:
    print(e, flush=True)
"""


def _stuck(phase: str, grace: float, tmp_path: Path) -> subprocess.Popen:
    script = tmp_path / "stuck.py"
    script.write_text(textwrap.dedent(STUCK).replace("GRACE", repr(grace)))
    proc = subprocess.Popen(
        [sys.executable, str(script), phase],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )
    assert proc.stdout.readline().strip() == "ready"
    # "ready" is printed just before os.system: a signal sent now could still meet a bytecode boundary and take
    # the Python-handler path. Its child existing means the main thread is inside the C call.
    deadline = time.time() + 30
    while not _children(proc.pid):
        assert time.time() < deadline and proc.poll() is None, "the stuck script never started its C call"
        time.sleep(0.05)
    return proc


def _children(pid: int) -> list[int]:
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(d.name))
            except (OSError, IndexError, ValueError):
                continue
    return found


def _end(proc: subprocess.Popen, within: float) -> tuple[str, str, float]:
    t0 = time.time()
    try:
        stdout, stderr = proc.communicate(timeout=within)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the script's group: it and the `sleep 60` it left orphaned
    return stdout, stderr, time.time() - t0


def test_grace_timer_runs_while_the_main_thread_is_in_a_long_c_call(tmp_path):
    proc = _stuck("loop", 2.0, tmp_path)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr, took = _end(proc, 45)
    assert proc.returncode == 1 and "returned" not in stdout, (stdout, stderr)
    assert "SIGTERM: no clean stop within preemption_grace_seconds=2; exiting" in stderr
    assert took < 40  # not the minute the C call takes


def test_a_second_sigterm_exits_at_once_in_a_long_c_call(tmp_path):
    proc = _stuck("loop", 300.0, tmp_path)
    proc.send_signal(signal.SIGTERM)
    time.sleep(1.5)  # a repeat within a second is one signal delivered twice (scheduler and launcher)
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    stdout, stderr, took = _end(proc, 40)
    assert proc.returncode == 128 + signal.SIGTERM, (stdout, stderr)
    assert "meshformer: SIGTERM again: exiting now" in stderr and took < 35


def test_a_stop_before_the_first_step_ends_the_command_with_exit_0(tmp_path):
    proc = _stuck("setup", 300.0, tmp_path)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr, took = _end(proc, 45)
    assert proc.returncode == 0 and "returned" not in stdout, (stdout, stderr)
    assert "SIGTERM: stopping now (no step in flight; nothing to save)" in stderr and took < 40
