"""Dense peak FLOP/s of the accelerators meshformer recognises: the one table the trainer's MFU and the planner read.

Figures are vendor data-sheet values without sparsity. `fp8` is the dense FP8 (E4M3/E5M2) tensor-core rate where
the device has one (compute capability 8.9 and newer); the planner puts the linears that fp8_config converts on it,
and the trainer's MFU stays against the bf16 figure, as torchtitan's does, so FP8 shows as a higher MFU.
fp32 matmuls run at `fp32` unless TF32 is on
(`torch.set_float32_matmul_precision("high")`, or `torch.backends.cuda.matmul.allow_tf32`), when NVIDIA's tensor
cores take them at `tf32`; meshformer itself never turns TF32 on, so an fp32 run's MFU is against the fp32 figure
unless the user asked for TF32.
A device the table does not know (a CPU) is timed instead: `measured_peak`, the best of square and linear-shaped
matmuls (below).
"""

from __future__ import annotations

import functools
import math
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
    """(FLOP/s, where it came from): the config, a known accelerator's data sheet, or timed matmuls (measured_peak:
    once per process, dtype and thread count)."""
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
    measured = measured_peak(device, dtype)
    return measured.flops, f"measured: best of {len(measured.rates)} matmuls, {measured.best}"


# ---------------------------------------------------------------- the measured peak
# The peak of a device without a data sheet is the best matmul it runs through torch: square sizes, and tall shapes,
# many rows (tokens) by the widths LLM layers have, in the `x @ w.t()` layout a linear runs. Squares alone understate
# it where the layers' own shapes run faster: on a Xeon with AMX a bf16 `[2048, 512] x [512, 1536]` runs faster than
# every square, so an MFU against the squares' best was overstated by as much (docs/benchmarks.md, "A fair CPU
# peak"). The widths are those of LLM layers (q/k/v/o, gate/up and down at ffn = 3 x hidden), the rows a step's
# tokens.
SQUARE_SIDES = (512, 1024, 2048, 4096, 8192)
TALL_ROWS = (2048, 8192)
TALL_WIDTHS = (
    (512, 512),
    (512, 1536),
    (1536, 512),
    (1024, 1024),
    (1024, 3072),
    (3072, 1024),
    (2048, 2048),
    (4096, 4096),
)
# Bounds on the measurement (the trainer runs it at start-up): shapes go cheapest first, each warmed up once and
# timed REPEATS times, more for a short call, up to MIN_TIMED_S of timed calls or MAX_REPEATS (a busy machine
# slows a call, never speeds one up: the fastest call is the hardware's limit, and a short call needs more tries
# to catch one unslowed); a shape whose call would take longer than MAX_CALL_S at the best rate so far is left
# out, and the timing stops before a shape would take it past BUDGET_S. On a slow unit (fp32 on a CPU) that leaves
# the largest shapes out, where the rate no longer changes with the shape.
REPEATS = 5
MAX_REPEATS = 20
MIN_TIMED_S = 0.03
MAX_CALL_S = 0.05
BUDGET_S = 2.0
_clock = time.perf_counter  # the one clock of the calls and the budget (a test replaces it)


@dataclass(frozen=True)
class MatmulShape:
    """[m, k] x [k, n]; `linear`: as a linear runs it, `x @ w.t()` with w [n, k] (else `a @ b`, b [k, n])."""

    m: int
    k: int
    n: int
    linear: bool

    @property
    def flops(self) -> int:
        return 2 * self.m * self.k * self.n

    def __str__(self) -> str:
        return f"[{self.m}, {self.k}] x [{self.k}, {self.n}]" + (" (x @ w.t())" if self.linear else "")


def peak_shapes() -> list[MatmulShape]:
    """The shapes a measured peak times, cheapest first."""
    squares = [MatmulShape(n, n, n, False) for n in SQUARE_SIDES]
    tall = [MatmulShape(m, k, n, True) for m in TALL_ROWS for k, n in TALL_WIDTHS]
    return sorted(squares + tall, key=lambda s: (s.flops, s.linear))


@dataclass(frozen=True)
class MeasuredPeak:
    flops: float  # the best rate of every matmul timed
    best: str  # which matmul ran at it
    rates: tuple[tuple[str, float], ...]  # (matmul and kernel, FLOP/s) of every one timed


@functools.lru_cache(maxsize=None)
def _measured_once(device: torch.device, dtype: torch.dtype, threads: int) -> MeasuredPeak:
    return measure_matmul_peak(device, dtype)


def measured_peak(device: torch.device, dtype: torch.dtype) -> MeasuredPeak:
    """measure_matmul_peak, once per process for each device, dtype and torch thread count."""
    return _measured_once(device, dtype, torch.get_num_threads())


def measure_matmul_peak(device: torch.device, dtype: torch.dtype, budget_s: float = BUDGET_S) -> MeasuredPeak:
    """The best FLOP/s of the peak_shapes this device runs through torch within `budget_s`. An fp32 CPU matmul is
    timed both ways torch can run it, its BLAS and oneDNN (backends/cpu.py): on CPUs not made by Intel MKL runs AVX2
    kernels, and only the faster library shows the hardware's limit."""
    kernels = _kernels(device, dtype)
    rates: list[tuple[str, float]] = []
    best = 0.0
    start = _clock()
    for shape in peak_shapes():
        call_s = shape.flops / best if best else 0.0
        shape_s = len(kernels) * ((1 + REPEATS) * call_s + MIN_TIMED_S)
        if call_s > MAX_CALL_S or _clock() - start + shape_s > budget_s:
            break
        a = _operand(shape.m, shape.k, device, dtype)
        b = _operand(shape.n, shape.k, device, dtype) if shape.linear else _operand(shape.k, shape.n, device, dtype)
        for name, kernel in kernels:
            fn = (lambda a, b, kernel=kernel: kernel(a, b.t())) if shape.linear and name == "torch" else kernel
            warm_up = _call_seconds(fn, a, b, device)  # a library's first call of a shape plans and packs
            repeats = min(MAX_REPEATS, max(REPEATS, math.ceil(MIN_TIMED_S / max(warm_up, 1e-9))))
            rate = shape.flops / min(_call_seconds(fn, a, b, device) for _ in range(repeats))
            rates.append((f"{shape} {name}", rate))
            best = max(best, rate)
    top = max(rates, key=lambda r: r[1])
    return MeasuredPeak(top[1], top[0], tuple(rates))


def _kernels(device: torch.device, dtype: torch.dtype) -> list[tuple[str, object]]:
    """(name, fn(a, b)) of the ways torch runs this matmul: `torch.matmul`, and on an fp32 CPU also oneDNN's
    `onednn_mm(a, b)` = a @ b.T (a linear's w as it is; the same work on square operands)."""
    kernels: list[tuple[str, object]] = [("torch", torch.matmul)]
    if device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available():
        from meshformer.backends.cpu import onednn_mm

        kernels.append(("oneDNN", onednn_mm))
    return kernels


_NOISE_ELEMENTS = 65_537  # a prime period, so no row of any shape repeats the one above it


def _operand(rows: int, cols: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A [rows, cols] operand of normal noise, tiled from one short draw (drawing every element costs as much as
    the matmul it feeds; a kernel's speed does not depend on the values)."""
    noise = torch.randn(_NOISE_ELEMENTS, device=device, dtype=dtype)
    reps = -(-rows * cols // _NOISE_ELEMENTS)
    return noise.repeat(reps)[: rows * cols].view(rows, cols)


def _call_seconds(fn, a: torch.Tensor, b: torch.Tensor, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = _clock()
    fn(a, b)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return _clock() - t0
