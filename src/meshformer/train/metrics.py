"""Throughput, MFU and memory accounting, and the metrics.jsonl log.

MFU = achieved model FLOP/s / peak FLOP/s. Model FLOPs per token follow the PaLM appendix (as Megatron and
torchtitan do): 6 x (parameters doing matmuls, i.e. all but the input embedding, plus the output projection tied or
not) + 12 x layers x heads x head_dim x seq_length for attention scores; recompute is not counted (it is overhead,
not model work). The rule is the model family's (models/registry.py), shared with the planner.
"""

from __future__ import annotations

import json
import math
from pathlib import Path


def plain_tensors(t):
    """The plain tensors that hold `t`'s data: a DTensor's local shard, and a tensor subclass that wraps others
    (an NF4 weight: 4-bit codes, int8 scales, factors) its inner tensors."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    if hasattr(t, "__tensor_flatten__") and not hasattr(t, "elem"):
        for name in t.__tensor_flatten__()[0]:
            yield from plain_tensors(getattr(t, name))
    else:
        yield t


def tensor_bytes(tensors) -> int:
    """Bytes of distinct storages (a DTensor counts its local shard, an NF4 weight its codes and scales)."""
    seen, total = set(), 0
    for t in (p for t in tensors if t is not None for p in plain_tensors(t)):
        st = t.untyped_storage()
        if st.data_ptr() in seen:
            continue
        seen.add(st.data_ptr())
        total += st.nbytes()
    return total


def _step(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


class MetricsLog:
    """One JSON object per optimizer step appended to {output_dir}/metrics.jsonl (metrics rank only)."""

    def __init__(self, output_dir: str | Path, enabled: bool, resume_step: int | None):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.enabled = enabled
        if enabled and resume_step is not None and self.path.exists():
            self.truncate(resume_step)
        elif enabled and resume_step is None and self.path.exists():
            self.path.unlink()

    def truncate(self, step: int) -> None:
        """Drop what was logged after `step` (resume from, or roll back to, a checkpoint of that step). A line cut
        off by a crash mid-write is dropped with the rest of what follows the checkpoint."""
        if self.enabled and self.path.exists():
            kept = [ln for ln in self.path.read_text().splitlines() if (_step(ln) or step + 1) <= step]
            self.path.write_text("".join(k + "\n" for k in kept))

    def write(self, record: dict) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(strict_json(record), allow_nan=False) + "\n")


def strict_json(record: dict) -> dict:
    """NaN and infinities are not JSON (`json.dumps` would write bare NaN that strict parsers reject): they become
    null, with the value's name kept under "<key>_nonfinite" so nothing is hidden."""
    out = {}
    for k, v in record.items():
        if isinstance(v, float) and not math.isfinite(v):
            out[k], out[f"{k}_nonfinite"] = None, str(v)
        else:
            out[k] = v
    return out
