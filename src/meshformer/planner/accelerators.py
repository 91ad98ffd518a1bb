"""Accelerators the planner knows: peak FLOP/s, memory and link bandwidths, each with its source.

Peaks are dense (no sparsity) vendor data-sheet figures from backends/peaks.py, the table the trainer's MFU reads
too; `cpu` is measured on the machine running the planner (a timed matmul, as the trainer's MFU does). Bandwidths
are per device and per direction: `intra` inside a node (NVLink, HCCS), `inter` between nodes (one NIC per device).
The planner's predicted times divide bytes by these and FLOPs by peak x an achievable fraction (`efficiency`), so
they are estimates, labelled as such.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshformer.backends.peaks import PEAKS

GB = 1e9


@dataclass(frozen=True)
class Accelerator:
    name: str
    peak_bf16: float  # dense bf16/fp16 FLOP/s
    peak_fp32: float  # FLOP/s of fp32 matmuls (TF32 off: meshformer never turns it on)
    memory_bytes: float
    intra_bw: float  # bytes/s per device per direction inside a node
    inter_bw: float  # bytes/s per device per direction between nodes
    devices_per_node: int
    runtime_bytes: float  # CUDA/CANN context + library workspaces the process holds outside the allocator
    source: str
    efficiency: float = 0.4  # share of peak meshformer's training step reaches (hardware FLOPs): see below
    host_bw: float = 50 * GB  # device <-> pinned host memory, bytes/s per direction (activation swap)
    communicator_bytes: float = 0.5 * (1 << 30)  # buffers of one collective communicator (NCCL/HCCL), per group
    peak_fp8: float | None = None  # dense FP8 FLOP/s (None: no FP8 units; fp8_config is planned at bf16)
    hbm_bw: float = 0.0  # device memory bytes/s: FP8's scaling and casting passes are bound by it
    gemm_efficiency: float = 0.7  # share of peak a large matmul kernel reaches, bf16 or FP8: see below

    def runtime(self, dims) -> float:
        """Bytes outside the tensors: the context, plus one communicator per parallel dimension in use (and the
        world group's)."""
        groups = sum(n > 1 for n in (dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp))
        groups += 1 if dims.world_size > 1 else 0
        return self.runtime_bytes + groups * self.communicator_bytes


ACCELERATORS = {
    "H100": Accelerator(
        "H100",
        PEAKS["H100"].bf16,
        PEAKS["H100"].fp32,
        80 * GB,
        450 * GB,
        50 * GB,
        8,
        0.8 * (1 << 30),
        "NVIDIA H100 SXM5 data sheet (989.4 TFLOP/s dense BF16, 80 GB HBM3, NVLink 900 GB/s both directions); "
        "400 Gb/s InfiniBand per GPU; FP8 1,978.9 TFLOP/s dense, HBM 3.35 TB/s",
        peak_fp8=PEAKS["H100"].fp8,
        hbm_bw=3.35e12,
    ),
    "H200": Accelerator(
        "H200",
        PEAKS["H200"].bf16,
        PEAKS["H200"].fp32,
        141 * GB,
        450 * GB,
        50 * GB,
        8,
        0.8 * (1 << 30),
        "NVIDIA H200 SXM data sheet (989.4 TFLOP/s dense BF16, 141 GB HBM3e, NVLink 900 GB/s); 400 Gb/s IB per GPU; "
        "FP8 1,978.9 TFLOP/s dense, HBM 4.8 TB/s",
        peak_fp8=PEAKS["H200"].fp8,
        hbm_bw=4.8e12,
    ),
    "A100": Accelerator(
        "A100",
        PEAKS["A100"].bf16,
        PEAKS["A100"].fp32,
        80 * GB,
        300 * GB,
        25 * GB,
        8,
        0.8 * (1 << 30),
        "NVIDIA A100 SXM4 80GB data sheet (312 TFLOP/s BF16, NVLink 600 GB/s both directions); 200 Gb/s IB per GPU",
    ),
    "910B": Accelerator(
        "910B",
        PEAKS["910B"].bf16,
        PEAKS["910B"].fp32,
        64 * GB,
        196 * GB,
        25 * GB,
        8,
        3.0 * (1 << 30),
        "Huawei Ascend 910B (Atlas 800T A2): 313 TFLOP/s FP16, 64 GB HBM2e, HCCS 392 GB/s both directions; "
        "200 Gb/s RoCE per NPU",
        efficiency=0.6,  # MindSpore's graph mode: its published Llama 2 7B figure (docs/memory.md)
        host_bw=25 * GB,  # PCIe Gen4 x16
    ),
}
ALIASES = {"ascend": "910B", "ascend910b": "910B", "atlas800ta2": "910B", "h100sxm": "H100", "a100sxm": "A100"}

# `efficiency`, the share of peak a training step's hardware FLOPs reach. NVIDIA: 0.4 is the middle of what
# meshformer's eager step reached on one H200, from a 1B shape at short sequences to an 8B shape at long ones
# (docs/benchmarks.md, "Training on one H200"); a bare large matmul reaches far more: the rest of a step is kernel
# launches, element-wise work, attention and the optimizer. `runtime_bytes`: what that process held outside the
# caching allocator, rounded up (docs/memory.md); a communicator's 0.5 GiB is an estimate (NCCL's default 4 MiB
# buffers x channels x peers), not a measurement. host_bw: PCIe Gen5 x16 pinned copies (docs/benchmarks.md).
# `gemm_efficiency`: the share of peak one large matmul kernel reaches (cuBLAS on Hopper, bf16 and FP8 alike), an
# assumption, not measured here: the FP8 plan (planner/throughput.py) takes the converted linears' matmul time at it
# out of the bf16 step and puts it back at the FP8 peak, so the rest of the step keeps the calibrated `efficiency`.


def cpu_accelerator(memory_bytes: float | None = None) -> Accelerator:
    """This machine's CPU, measured: fp32 matmul FLOP/s (bf16 too: without AVX-512 BF16/AMX it is emulated)."""
    import torch

    from meshformer.backends.peaks import peak_flops
    from meshformer.planner.fits import device_memory_bytes

    cpu = torch.device("cpu")
    fp32, _ = peak_flops(cpu, torch.float32, 0)
    bf16, _ = peak_flops(cpu, torch.bfloat16, 0)
    mem = memory_bytes or device_memory_bytes(cpu) or 16 * GB
    return Accelerator(
        "cpu",
        bf16,
        fp32,
        mem,
        5 * GB,
        1 * GB,
        1,
        0.3 * (1 << 30),
        "measured here (timed matmul); gloo over loopback",
        efficiency=0.6,
        communicator_bytes=0,
    )


def find_accelerator(name: str | None) -> Accelerator:
    """A known accelerator by name (case-insensitive; None or 'cpu': this machine's CPU, measured)."""
    from meshformer.errors import UserError

    if name is None or name.lower() == "cpu":
        return cpu_accelerator()
    key = name.replace(" ", "").replace("-", "").replace("_", "")
    for k in ACCELERATORS:
        if key.lower() == k.lower():
            return ACCELERATORS[k]
    if key.lower() in ALIASES:
        return ACCELERATORS[ALIASES[key.lower()]]
    raise UserError(f"--accelerator {name!r}: one of {', '.join([*ACCELERATORS, 'cpu'])}")
