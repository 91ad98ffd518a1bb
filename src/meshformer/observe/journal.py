"""The tuning journal: one line per run with its config change against the previous run and what it got.

Recording every config change with its memory and throughput, made automatic. When a run ends, the metrics rank writes
`{output_dir}/run_summary.json` (the effective config, flattened to dotted keys, and the run's figures) and appends
the same, plus `changes` against the journal's previous line, to the journal: `monitor_config.journal` (`auto`:
`journal.jsonl` beside output_dir, so the runs of one directory of experiments share it; empty: none). `meshformer
journal` prints it; `meshformer compare A B` puts two runs' config diff beside their metric diff.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

SUMMARY = "run_summary.json"
# Keys that name where a run writes, not what it is: never reported as changes.
_NOT_CHANGES = {"output_dir", "overwrite_output_dir", "resume_training", "monitor_config.progress_bar"}


def flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def config_changes(before: dict, after: dict) -> dict:
    """{dotted key: [before, after]} of the keys whose values differ (None where a side lacks the key)."""
    keys = sorted((set(before) | set(after)) - _NOT_CHANGES)
    return {k: [before.get(k), after.get(k)] for k in keys if before.get(k) != after.get(k)}


def journal_path(cfg) -> Path | None:
    setting = cfg.monitor_config.journal
    if not setting:
        return None
    if setting == "auto":
        return Path(cfg.output_dir).resolve().parent / "journal.jsonl"
    return Path(setting)


def summarize(cfg, dims, records: list[dict], global_batch: int) -> dict:
    """The run's line: its config and the figures of the steps it ran."""
    from meshformer.config.load import to_dict

    def median(key):
        vals = [r[key] for r in records if isinstance(r.get(key), (int, float))]
        return statistics.median(vals) if vals else None

    last = records[-1] if records else {}
    evals = [r["eval_loss"] for r in records if r.get("eval_loss") is not None]
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "output_dir": str(Path(cfg.output_dir).resolve()),
        "layout": f"dp{dims.dp} x tp{dims.tp} x pp{dims.pp}"
        + (f" (fsdp {dims.dp_shard})" if dims.dp_shard > 1 else ""),
        "devices": dims.world_size,
        "global_batch": global_batch,
        "seq_length": cfg.model.model_config.seq_length,
        "steps": last.get("step"),
        "tokens_per_s": median("tokens_per_s"),
        "mfu": median("mfu"),
        "step_time_s": median("step_time_s"),
        "peak_mem_bytes": max((r.get("peak_mem_bytes") or 0 for r in records), default=None),
        "loss": last.get("loss"),
        "eval_loss": evals[-1] if evals else None,
        "config": flatten(to_dict(cfg)),
    }


def record_run(cfg, summary: dict) -> Path | None:
    """Write run_summary.json and append the journal line (metrics rank). Returns the journal's path."""
    out = Path(cfg.output_dir)
    (out / SUMMARY).write_text(json.dumps(summary, indent=1, default=str) + "\n")
    path = journal_path(cfg)
    if path is None:
        return None
    previous = read_journal(path)
    line = {**summary, "changes": config_changes(previous[-1]["config"], summary["config"]) if previous else {}}
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(line, default=str) + "\n")
    return path


def read_journal(path: Path) -> list[dict]:
    if not path.exists():
        return []
    lines = []
    for text in path.read_text().splitlines():
        try:
            lines.append(json.loads(text))
        except json.JSONDecodeError:
            continue  # a line cut off by a crash: the others stand
    return lines


def read_summary(run_dir: Path) -> dict:
    from meshformer.errors import UserError

    path = Path(run_dir) / SUMMARY
    if not path.exists():
        raise UserError(f"{run_dir}: no {SUMMARY} (written when a training run ends): give the output_dir of a run")
    return json.loads(path.read_text())
