"""torch.profiler around training steps: MindSpore's `profile` window, and the communication probe of logging steps.

`profile: true` records steps `profile_start_step`..`profile_stop_step` (1-based, inclusive; `--profile A:B` on the
command line) and, when the window closes, every rank writes to `{output_dir}/profile/`:
  trace_rank<r>.json      Chrome trace format: open in https://ui.perfetto.dev or chrome://tracing
  top_ops_rank<r>.txt     the operators that took the most time (torch's key_averages table), also printed by the
                          metrics rank
  memory_rank<r>.pickle   on a GPU with `profile_memory`: the CUDA allocator's history (pytorch.org/memory_viz)
Outside the window, a logging step (MFLossMonitor's per_print_times) runs under a light CPU(+CUDA) profiler so
metrics.jsonl can say how much of it was spent in collectives (`time_comm_s`, observe/timing.py): at most every
`PROBE_EVERY` steps (logging every step is common, and the probe costs that step a little), and the last step.

Kineto (torch.profiler's backend) writes `USDT:... SyncActivityProfilerHandler.cpp:52] profiler_start` (and
`profiler_stop`) to stderr on every start and stop, at its USDT severity, which ranks above ERROR: no
KINETO_LOG_LEVEL silences them without silencing kineto's errors too. So stderr is caught around each start and
stop and written back at once without exactly those lines (`_without_kineto_markers`); anything else passes.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from pathlib import Path

from torch.profiler import ProfilerActivity, profile, record_function

from meshformer.backends.torch_private import dump_cuda_memory_snapshot, record_cuda_memory_history
from meshformer.observe.timing import comm_seconds

STEP_EVENT = "meshformer_step"
PROBE_EVERY = 10
_KINETO_MARKER = re.compile(rb"USDT:[^\n]*\] profiler_(start|stop)\r?\n?")


@contextlib.contextmanager
def _without_kineto_markers():
    """File descriptor 2 into a temporary file for the block, then the file back to it minus kineto's markers."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no usable stderr: nothing to keep clean
        yield
        return
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.flush()  # Python's own writes in the block belong to the caught ones
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = b"".join(line for line in caught if not _KINETO_MARKER.fullmatch(line))
            if kept:
                os.write(2, kept)


def _enter(prof: profile) -> None:
    with _without_kineto_markers():
        prof.__enter__()


def _exit(prof: profile) -> None:
    with _without_kineto_markers():
        prof.__exit__(None, None, None)


class StepProfiler:
    def __init__(self, cfg, env, out_dir: Path, log):
        self.env, self.log = env, log
        self.enabled = bool(cfg.profile)
        self.first, self.last = cfg.profile_start_step, cfg.profile_stop_step
        self.memory = cfg.profile_memory and env.device.type == "cuda"
        self.dir = Path(out_dir) / "profile"
        self._window = None
        self._probe = None
        self._last_probe = -PROBE_EVERY
        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if env.device.type == "cuda" else [])

    def probe_due(self, step: int, last_step: int) -> bool:
        """A logging step gets the communication probe if none ran in the last PROBE_EVERY steps (or it is last)."""
        if step - self._last_probe >= PROBE_EVERY or step == last_step:
            self._last_probe = step
            return True
        return False

    def in_window(self, step: int) -> bool:
        return self.enabled and self.first <= step <= self.last

    @contextlib.contextmanager
    def step(self, step: int, logging: bool):
        """Wrap one step (1-based `step`): inside the profile window it is recorded; on a logging step outside it,
        probed for communication time."""
        if self.in_window(step) and self._window is None:
            self._open_window()
        if self._window is None and logging:
            self._probe = profile(activities=self.activities)
            _enter(self._probe)
        try:
            with record_function(STEP_EVENT):
                yield
        finally:
            if self._probe is not None:
                _exit(self._probe)
            if self._window is not None:
                self._window.step()
                if step >= self.last:
                    self._close_window()

    def comm_seconds(self) -> float | None:
        """Collective time of the step just probed (None when it was not probed)."""
        if self._probe is None:
            return None
        try:
            return comm_seconds(self._probe, STEP_EVENT)
        finally:
            self._probe = None

    def _open_window(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.memory:
            record_cuda_memory_history(200_000)
        self._window = profile(activities=self.activities, record_shapes=True, profile_memory=True, with_stack=False)
        _enter(self._window)

    def _close_window(self) -> None:
        prof, self._window = self._window, None
        _exit(prof)
        r = self.env.rank
        prof.export_chrome_trace(str(self.dir / f"trace_rank{r}.json"))
        sort = "self_cuda_time_total" if self.env.device.type == "cuda" else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=25)
        (self.dir / f"top_ops_rank{r}.txt").write_text(table + "\n")
        if self.memory:
            dump_cuda_memory_snapshot(str(self.dir / f"memory_rank{r}.pickle"))
            record_cuda_memory_history(None)
        if self.env.is_metrics_rank:
            self.log(f"profile of steps {self.first}-{self.last} in {self.dir} (trace_rank*.json: Perfetto)\n{table}")

    def close(self) -> None:
        """The run ended inside the window: write what was recorded."""
        if self._window is not None:
            self._close_window()
