"""Dense peak FLOP/s of the accelerators meshformer recognises: the one table the trainer's MFU and the planner read.

Figures are vendor data-sheet values without sparsity. `fp8` is the dense FP8 (E4M3/E5M2) tensor-core rate where
the device has one (compute capability 8.9 and newer); the planner puts the linears that fp8_config converts on it,
and the trainer's MFU stays against the bf16 figure, as torchtitan's does, so FP8 shows as a higher MFU.
fp32 matmuls run at `fp32` unless TF32 is on
(`torch.set_float32_matmul_precision("high")`, or `torch.backends.cuda.matmul.allow_tf32`), when NVIDIA's tensor
cores take them at `tf32`; meshformer itself never turns TF32 on, so an fp32 run's MFU is against the fp32 figure
unless the user asked for TF32.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from meshformer.backends.cpu import cpu_has_bf16


@dataclass(frozen=True)
class Peaks:
    bf16: float  # dense bf16/fp16 FLOP/s
    fp32: float  # fp32 matmuls on the vector units (TF32 off)
    tf32: float | None  # fp32 matmuls on the tensor cores with TF32 on; None: the device has no TF32 mode
    source: str
    fp8: float | None = None  # dense FP8 FLOP/s; None: no FP8 tensor cores


PEAKS = {
    "H200": Peaks(
        989.4e12, 66.9e12, 494.7e12, "NVIDIA H200 SXM data sheet (dense; TF32 989, FP8 3,958 with sparsity)", 1978.9e12
    ),
    "H100": Peaks(
        989.4e12, 66.9e12, 494.7e12, "NVIDIA H100 SXM5 data sheet (dense; TF32 989, FP8 3,958 with sparsity)", 1978.9e12
    ),
    "H100-96GB": Peaks(
        835.5e12,
        60e12,
        417.8e12,
        "NVIDIA H100 NVL data sheet (dense; the 96 GB HBM2e H100 at 500 W lies between NVL and SXM5)",
        1670.5e12,
    ),
    "A100": Peaks(312e12, 19.5e12, 156e12, "NVIDIA A100 SXM4 data sheet (dense; TF32 312 with sparsity)"),
    "L40S": Peaks(362.05e12, 91.6e12, 183e12, "NVIDIA L40S data sheet (dense; FP8 1,466 with sparsity)", 733e12),
    "A10": Peaks(125e12, 31.2e12, 62.5e12, "NVIDIA A10 data sheet (dense)"),
    "4090": Peaks(
        165.2e12, 82.6e12, 82.6e12, "NVIDIA Ada GeForce RTX 4090 whitepaper (dense, fp32 accumulate)", 330.3e12
    ),
    "910B": Peaks(313e12, 75e12, None, "Huawei Ascend 910B (Atlas 800T A2): 313 TFLOP/s FP16"),
}


def tf32_enabled() -> bool:
    """Whether fp32 matmuls on CUDA may use TF32 (either of torch's switches)."""
    return torch.get_float32_matmul_precision() != "highest" or bool(torch.backends.cuda.matmul.allow_tf32)


def peak_of(peaks: Peaks, dtype: torch.dtype, tf32: bool) -> float:
    """The FLOP/s matmuls in `dtype` reach on this device: bf16/fp16, fp32 with TF32 on, or plain fp32."""
    if dtype != torch.float32:
        return peaks.bf16
    return peaks.tf32 if tf32 and peaks.tf32 is not None else peaks.fp32


def known_peaks(device_name: str) -> tuple[str, Peaks] | None:
    """(table key, peaks) of a device whose name contains a key of the table (`torch.cuda.get_device_name`)."""
    for key, peaks in PEAKS.items():
        if key in device_name:
            return key, peaks
    return None


def peak_flops(device: torch.device, dtype: torch.dtype, configured: float) -> tuple[float, str]:
    """(FLOP/s, where it came from): the config, a known accelerator's data sheet, or a timed matmul."""
    if configured > 0:
        return configured, "config"
    if device.type == "cuda":
        known = known_peaks(torch.cuda.get_device_name(device))
        if known is not None:
            tf32 = dtype == torch.float32 and tf32_enabled() and known[1].tf32 is not None
            return peak_of(known[1], dtype, tf32_enabled()), f"datasheet:{known[0]}" + (" (TF32 on)" if tf32 else "")
    if device.type == "cpu" and dtype != torch.float32 and not cpu_has_bf16():
        # Without AVX-512 BF16 or AMX a bf16 matmul is converted to fp32 work: the fp32 peak is the hardware limit
        # (timing the slow conversion path instead overstates MFU several times over when the model's own matmuls
        # take a faster one: docs/benchmarks.md).
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
