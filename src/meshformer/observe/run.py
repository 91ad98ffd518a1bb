"""What a training run reports beside metrics.jsonl, behind one object the trainer drives: the experiment trackers
(TensorBoard, W&B, MLflow, SwanLab: observe/trackers.py), the profiler (window and communication probe), and the
figures of its journal line.

The journal's medians are over the last `WINDOW` steps (the steady state; a long run's records are not all kept in
memory); the peak memory and the last evaluation loss are kept over the whole run.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

from meshformer.observe.journal import record_run, summarize
from meshformer.observe.profile import StepProfiler
from meshformer.observe.trackers import Trackers

WINDOW = 1000


class RunObservers:
    def __init__(self, cfg, env, out_dir: Path, log, resuming: bool = False):
        """resuming: the run continues from a checkpoint (the trackers continue their runs)."""
        self.trackers = Trackers(cfg, env.is_metrics_rank, out_dir, resuming, log)
        self.profiler = StepProfiler(cfg, env, out_dir, log)
        self.recent: deque[dict] = deque(maxlen=WINDOW)
        self.peak_mem = 0
        self.eval_loss = None

    def step(self, step: int, logging: bool, last_step: int):
        """The context one step runs in (profile window, or the communication probe on a logging step)."""
        return self.profiler.step(step, logging and self.profiler.probe_due(step, last_step))

    def comm_time(self) -> dict:
        seconds = self.profiler.comm_seconds()
        return {} if seconds is None else {"time_comm_s": seconds}

    def write(self, rec: dict) -> None:
        self.trackers.write(rec)
        self.recent.append(rec)
        self.peak_mem = max(self.peak_mem, rec.get("peak_mem_bytes") or 0)
        if rec.get("eval_loss") is not None:
            self.eval_loss = rec["eval_loss"]

    def roll_back(self, step: int) -> None:
        """The run went back to `step`: what was recorded after it no longer happened."""
        kept = [r for r in self.recent if r["step"] <= step]
        self.recent = deque(kept, maxlen=WINDOW)

    def close(self) -> None:
        self.profiler.close()

    def abandon(self) -> None:
        """The run failed: the trackers mark their runs failed."""
        self.trackers.abandon()

    def finish(self, cfg, dims, global_batch: int) -> Path | None:
        """Write run_summary.json and the journal line (metrics rank), hand the summary to the trackers and let
        them finish; returns the journal's path."""
        if not self.recent:
            self.trackers.finish(None)
            return None
        summary = summarize(cfg, dims, list(self.recent), global_batch)
        summary["peak_mem_bytes"] = self.peak_mem or summary["peak_mem_bytes"]
        summary["eval_loss"] = self.eval_loss
        try:
            return record_run(cfg, summary)
        finally:
            self.trackers.finish(summary)
