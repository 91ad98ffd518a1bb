"""Where a step's time goes: data, forward/backward, optimizer, the rest, and (on logging steps) collectives.

`StepClock` splits a step into phases by wall-clock laps; on a GPU by CUDA events on the compute stream, so a
phase is charged with the device time between its start and end marks (the kernels it queued), read once the
step has ended, without waiting for the device at every lap. The phases add up to the
step time by construction (`time_other_s` is what none of them covers: the global token count and loss
reductions, the learning-rate schedule, memory accounting), so a large `time_other_s` is itself a finding.

`comm_seconds` reads a torch.profiler record of one step: the union of the intervals the step's own thread spent
in collective calls and waits (gloo runs them there; FSDP's and DDP's waits too), and on a GPU the union of the
NCCL kernels' intervals. Overlapped communication that nobody waited for is not counted: that is the point, the
number is what communication costs the step.
"""

from __future__ import annotations

import time

import torch

PHASES = ("data", "fwd_bwd", "optim")

_COMM_PREFIXES = ("c10d::", "_c10d_functional::", "c10d_functional::", "record_param_comms", "fsdp::", "FSDP::")
_COMM_WORDS = (
    "wait",
    "all_reduce",
    "allreduce",
    "all_gather",
    "allgather",
    "reduce_scatter",
    "broadcast",
    "send",
    "recv",
    "all_to_all",
)


class StepClock:
    """Laps through one step's phases: wall-clock on a CPU; on a GPU a CUDA event per lap, read after the step's
    closing synchronisation (waiting for the device at each lap would stall the host before every phase: a
    per-step cost the breakdown must not add)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.start = self._last = time.perf_counter()
        self.laps: dict[str, float] = {}
        self._events: list[tuple[str, torch.cuda.Event]] = []
        if device.type == "cuda":
            self._events.append(("", self._event()))

    def _event(self):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def lap(self, phase: str) -> None:
        if self._events:
            self._events.append((phase, self._event()))
            return
        now = time.perf_counter()
        self.laps[phase] = self.laps.get(phase, 0.0) + now - self._last
        self._last = now

    def breakdown(self, total_s: float) -> dict[str, float]:
        """time_<phase>_s for each phase and time_other_s = the rest of `total_s` (on a GPU, call it after the
        step's closing torch.cuda.synchronize: the events are read then)."""
        for (_, a), (phase, b) in zip(self._events, self._events[1:]):
            self.laps[phase] = self.laps.get(phase, 0.0) + a.elapsed_time(b) / 1e3
        self._events = self._events[-1:]
        out = {f"time_{p}_s": self.laps.get(p, 0.0) for p in PHASES}
        out["time_other_s"] = max(0.0, total_s - sum(out.values()))
        return out


def _is_comm(name: str) -> bool:
    low = name.lower()
    return name.startswith(_COMM_PREFIXES) or any(w in low for w in _COMM_WORDS)


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def comm_seconds(prof, step_event: str) -> float:
    """Seconds of one profiled step spent in collectives (see the module doc)."""
    events = list(prof.events())
    step = next((e for e in events if e.name == step_event), None)
    if step is None:
        return 0.0
    thread = step.thread
    cpu = [
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.thread == thread and e.name != step_event and _is_comm(e.name)
    ]
    gpu = [
        (e.time_range.start, e.time_range.end)
        for e in events
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA and "nccl" in e.name.lower()
    ]
    return max(_union(cpu), _union(gpu)) / 1e6  # the profiler's times are microseconds
