"""What lets a killed `preprocess` continue: its temporary directory `.NAME.tmp-PID` holds `job.json` (what is
being made: the inputs with their sizes and modification times, the tokenizer's hash, every option that changes
the output), `scan.json` once pass 1 is done, and `progress.json` after every batch written (the units consumed
and each split writer's state). A new run of the same job claims a dead run's directory and carries on."""

from __future__ import annotations

import json
import os
from pathlib import Path

JOB, SCAN, PROGRESS = "job.json", "scan.json", "progress.json"
SCRATCH = (JOB, SCAN, PROGRESS, "decisions.bin", "seen.sqlite")  # removed before the dataset is published


def job_description(paths: list[Path], tokenizer_hash: str, **options) -> dict:
    inputs = []
    for p in paths:
        files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
        inputs.append([str(p.resolve()), [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files]])
    return {"version": 1, "inputs": inputs, "tokenizer_hash": tokenizer_hash, **options}


def _read(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_json(path: Path, data: dict) -> None:
    """Atomically: a kill mid-write leaves the previous version."""
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(json.dumps(data) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def claim(out: Path, job: dict, alive) -> Path | None:
    """Rename the temporary directory of a dead run of the same job to this process's name; None if there is none
    (clean_stale_temps then removes the others)."""
    if not out.parent.is_dir():
        return None
    mine = out.parent / f".{out.name}.tmp-{os.getpid()}"
    for p in sorted(out.parent.glob(f".{out.name}.tmp-*")):
        pid = p.name.rpartition("-")[2]
        if p != mine and pid.isdigit() and p.is_dir() and not alive(int(pid)) and _read(p / JOB) == job:
            p.rename(mine)
            return mine
    return None


def read_scan(tmp: Path) -> dict | None:
    return _read(tmp / SCAN)


def read_progress(tmp: Path) -> dict | None:
    return _read(tmp / PROGRESS)
