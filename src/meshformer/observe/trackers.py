"""Experiment trackers (`report_to`): every metrics.jsonl row, the resolved config and the run summary, sent from
the metrics rank to TensorBoard, Weights & Biases, MLflow or SwanLab (a file per tracker beside this one).

A tracker is an object with `open(run) -> run id | None`, `log(step, values)` and `finish(summary)`. Each runs on a
thread of its own behind a queue (observe/tracker_thread.py), so a slow disk, a hung service or an exception never
holds up a training step: a tracker that fails is reported once and dropped, and training goes on. The run ids
trackers give are kept in {output_dir}/trackers.json, so a resumed run (resume_training) continues the same tracker
run; a fresh run starts new ones.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from meshformer.config.tracker_schema import report_to_names
from meshformer.errors import UserError
from meshformer.observe.tracker_thread import TrackerThread

IDS_FILE = "trackers.json"
DEFAULT_PROJECT = "meshformer"

# name -> (module of its class, the class, the package it needs, the pip extra that installs it)
REGISTRY = {
    "tensorboard": ("meshformer.observe.tensorboard", "TensorBoardTracker", "tensorboard", None),
    "wandb": ("meshformer.observe.wandb_tracker", "WandbTracker", "wandb", "wandb"),
    "mlflow": ("meshformer.observe.mlflow_tracker", "MlflowTracker", "mlflow", "mlflow"),
    "swanlab": ("meshformer.observe.swanlab_tracker", "SwanlabTracker", "swanlab", "swanlab"),
}


@dataclass
class TrackerRun:
    """What a tracker opens its run with."""

    project: str  # tracker_config.project ("" : the tracker's own environment variable, else meshformer)
    name: str  # run_name, else output_dir's folder name
    dir: Path | None  # tracker_config.dir (None: the tracker's own environment variable, else output_dir)
    output_dir: Path
    config: dict  # the resolved config, nested as config.yaml writes it
    resume_id: str | None  # the tracker's run id to continue (a resumed run), None for a new run
    options: dict = field(default_factory=dict)  # a tracker's own settings from the config (TensorBoard's)

    def project_or(self, env_var: str) -> str:
        return self.project or os.environ.get(env_var) or DEFAULT_PROJECT

    def dir_or(self, env_var: str) -> Path | None:
        """The directory a tracker writes into: tracker_config.dir, else None when its environment variable says
        where (the tracker reads it itself), else output_dir."""
        if self.dir is not None:
            return self.dir
        return None if os.environ.get(env_var) else self.output_dir


def tracker_values(record: dict) -> dict[str, float]:
    """The numbers of a metrics.jsonl row a tracker charts: every int or float field but the step; a non-finite
    value (null in metrics.jsonl) is left out, as TensorBoard leaves it out."""
    return {
        k: v
        for k, v in record.items()
        if k != "step" and not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
    }


def check_trackers_installed(cfg, env=None) -> None:
    """Refuse, before any work, a tracker whose package is not installed (a preflight of `meshformer train`)."""
    for name in report_to_names(cfg.report_to):
        _, _, package, extra = REGISTRY[name]
        if extra is not None and not _installed(package):
            raise UserError(
                f"report_to: {name} is not installed: pip install 'meshformer[{extra}]' (or remove {name} from "
                "report_to)"
            )


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules, or a broken parent package
        return False


class Trackers:
    """The run's trackers (metrics rank; elsewhere none), each on its own thread."""

    def __init__(self, cfg, enabled: bool, out_dir: Path, resuming: bool, log):
        self.out, self.log = Path(out_dir), log
        self.threads: list[TrackerThread] = []
        self._ids_lock = threading.Lock()
        self.finish_timeout = cfg.tracker_config.finish_timeout
        if not enabled:
            return
        names = report_to_names(cfg.report_to)
        ids = self._read_ids() if resuming else {}
        if not resuming and names and (self.out / IDS_FILE).exists():
            (self.out / IDS_FILE).unlink()  # a fresh run's trackers start new runs
        for name in names:
            if name == "tensorboard" and not cfg.tensorboard.tensorboard_dir:
                continue  # TensorBoard is on where MindSpore's tensorboard_dir says
            run = _tracker_run(cfg, self.out, ids.get(name))
            thread = TrackerThread(name, lambda n=name: _build(n), run, log, self._keep_id)
            self.threads.append(thread)

    def write(self, record: dict) -> None:
        """One metrics.jsonl row (as written there), to every tracker; returns at once."""
        values = tracker_values(record)
        for t in self.threads:
            t.log(int(record["step"]), values)

    def finish(self, summary: dict | None) -> None:
        """The run ended: hand each tracker the summary (None: no step ran) and wait, at most finish_timeout
        seconds in all, for them to write what they were given."""
        for t in self.threads:
            t.finish(summary)
        self._join()

    def abandon(self) -> None:
        """The run failed: each tracker marks its run failed; waits as finish does."""
        for t in self.threads:
            t.abandon()
        self._join()

    def _join(self) -> None:
        deadline = time.monotonic() + self.finish_timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self.threads = []

    def _read_ids(self) -> dict:
        try:
            ids = json.loads((self.out / IDS_FILE).read_text())
        except (OSError, ValueError):
            return {}
        return ids if isinstance(ids, dict) else {}

    def _keep_id(self, name: str, run_id: str) -> None:
        """Record a tracker's run id for a resumed run (called from the tracker's thread)."""
        with self._ids_lock:
            ids = {**self._read_ids(), name: run_id}
            tmp = self.out / f"{IDS_FILE}.tmp"
            tmp.write_text(json.dumps(ids, indent=1) + "\n")
            os.replace(tmp, self.out / IDS_FILE)


def _tracker_run(cfg, out: Path, resume_id: str | None) -> TrackerRun:
    from meshformer.config.load import to_dict

    tc = cfg.tracker_config
    return TrackerRun(
        project=tc.project,
        name=cfg.run_name or Path(out).resolve().name,
        dir=Path(tc.dir) if tc.dir else None,
        output_dir=Path(out),
        config=to_dict(cfg),
        resume_id=resume_id,
        options={"tensorboard_dir": cfg.tensorboard.tensorboard_dir, "queue": cfg.tensorboard.tensorboard_queue_size},
    )


def _build(name: str):
    """The tracker's object (imports its module, and so its package, on the tracker's own thread)."""
    module, cls, _, _ = REGISTRY[name]
    return getattr(importlib.import_module(module), cls)()
