"""Throughput, MFU and memory accounting, and the metrics.jsonl log.

MFU = achieved model FLOP/s / peak FLOP/s. Model FLOPs per token follow the PaLM appendix (as Megatron and
torchtitan do): 6 x (parameters doing matmuls, i.e. all but the input embedding, plus the output projection tied or
not) + 12 x layers x heads x head_dim x seq_length for attention scores; recompute is not counted (it is overhead,
not model work). The rule is the model family's (models/registry.py), shared with the planner.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from meshformer.backends.cpu import cpu_has_bf16
from meshformer.config.schema import ModelConfig

# Dense bf16 peak FLOP/s per device, from vendor data sheets (used instead of measuring when recognised).
KNOWN_PEAKS = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12, "4090": 165.2e12}


def flops_per_token(mc: ModelConfig, n_params: int | None = None, n_embedding: int | None = None) -> float:
    """The model family's one FLOPs rule (models/registry.py), the planner's too. The counts are not used: the
    rule counts from the config (a tied head's matmul included); they stay in the signature for existing callers."""
    from meshformer.models.registry import family_of

    return family_of(mc).flops_per_token(mc)


def peak_flops(device: torch.device, dtype: torch.dtype, configured: float) -> tuple[float, str]:
    """(FLOP/s, where it came from): the config, a known accelerator's data sheet, or a timed matmul."""
    if configured > 0:
        return configured, "config"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, val in KNOWN_PEAKS.items():
            if key in name:
                return (val if dtype != torch.float32 else val / 2), f"datasheet:{key}"
    if device.type == "cpu" and dtype != torch.float32 and not cpu_has_bf16():
        # Without AVX-512 BF16 or AMX a bf16 matmul is converted to fp32 work: the fp32 peak is the hardware limit
        # (timing the slow conversion path instead gave MFUs of 400% when the model's own matmuls took a faster one).
        fp32, _ = peak_flops(device, torch.float32, 0)
        return fp32, "measured fp32 (this CPU has no bf16 matmul units)"
    # The best of several large matmuls: sizes from 512 up until one takes ~50 ms, each timed five times; a busy
    # machine slows some runs, never speeds one up, and the fastest size is the hardware's limit for this work.
    # An fp32 CPU matmul is timed both ways torch can run it, its BLAS and oneDNN (backends/cpu.py): on CPUs
    # not made by Intel MKL runs AVX2 kernels, and only the faster library shows the hardware's limit.
    fns = [torch.matmul]
    if device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available():
        from meshformer.backends.cpu import onednn_mm

        fns.append(onednn_mm)  # a @ b.T: the same work on square operands
    n, rate = 128, 0.0
    while True:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        for fn in fns:
            fn(a, b)
        best = min(_timed_matmul(fn, a, b, device) for fn in fns for _ in range(5 if n >= 512 else 1))
        if n >= 512:
            rate = max(rate, 2 * n**3 / best)
        if best > 0.05 or n >= 8192:
            return rate or 2 * n**3 / best, "measured"
        n *= 2


def _timed_matmul(fn, a: torch.Tensor, b: torch.Tensor, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn(a, b)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def tensor_bytes(tensors) -> int:
    """Bytes of distinct storages (a DTensor counts its local shard)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):
            t = t.to_local()
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
