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
# Element-wise bytes per hardware FLOP of meshformer's step at hidden size 4096 (`Accelerator.step_efficiency`):
# the H200's measured step time less its matmuls at `gemm_efficiency` and its optimizer step, times the HBM
# bandwidth, over the FLOPs (docs/memory.md, "Published runs"; tests/unit/test_published_runs.py holds the H200
# rows to them).
EAGER_BYTES_PER_FLOP = 0.00234
COMPILED_BYTES_PER_FLOP = 0.00148


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
    efficiency: float = 0.4  # share of peak a step reaches where no memory bandwidth is known (hbm_bw 0): below
    host_bw: float = 50 * GB  # device <-> pinned host memory, bytes/s per direction (activation swap)
    communicator_bytes: float = 0.5 * (1 << 30)  # buffers of one collective communicator (NCCL/HCCL), per group
    peak_fp8: float | None = None  # dense FP8 FLOP/s (None: no FP8 units; fp8_config is planned at bf16)
    hbm_bw: float = 0.0  # device memory bytes/s: FP8's scaling and casting passes are bound by it
    gemm_efficiency: float = 0.7  # share of peak a large matmul kernel reaches, bf16 or FP8: see below

    def step_efficiency(self, peak: float, compiled: bool, recomputed: bool, hidden: int, item: int = 2) -> float:
        """Share of `peak` a training step's hardware FLOPs reach: its matmuls at `gemm_efficiency`, the rest of
        the step (norms, rotary, SwiGLU's product, residual adds, the loss: memory-bound element-wise kernels) as
        bytes at the HBM bandwidth. Those bytes grow with the activations a token makes (~ hidden) and the FLOPs
        with the weights (~ hidden^2), so per FLOP they fall as 1 / hidden; compiled layers move fewer (Inductor
        fuses the kernels), and they scale with the compute dtype's size `item` (calibrated in bf16). An eager
        step that recomputes (selective or full) runs its forward's element-wise kernels again: a third more."""
        if not self.hbm_bw:
            return self.efficiency
        per_flop = (COMPILED_BYTES_PER_FLOP if compiled else EAGER_BYTES_PER_FLOP) * 4096 / hidden * item / 2
        per_flop *= 4 / 3 if recomputed and not compiled else 1
        return 1 / (1 / self.gemm_efficiency + per_flop * peak / self.hbm_bw)

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
        "NVIDIA A100 SXM4 80GB data sheet (312 TFLOP/s BF16, NVLink 600 GB/s both directions, HBM2e 2.04 TB/s); "
        "200 Gb/s IB per GPU",
        hbm_bw=2.039e12,
    ),
    "H100-96GB": Accelerator(
        "H100-96GB",
        PEAKS["H100-96GB"].bf16,
        PEAKS["H100-96GB"].fp32,
        96 * (1 << 30),
        450 * GB,
        50 * GB,
        8,
        0.8 * (1 << 30),
        "H100 with 96 GB HBM2e at 2.4 TB/s and a 500 W limit (Meta's Grand Teton hosts, torchtitan's published "
        "runs): its peak lies between the SXM5's and the NVL's, so the NVL data sheet's (835 TFLOP/s dense BF16, "
        "1,670 FP8); six 16 GiB HBM stacks; NVLink 900 GB/s; 400 Gb/s RDMA per GPU",
        peak_fp8=PEAKS["H100-96GB"].fp8,
        hbm_bw=2.4e12,
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
ALIASES = {
    "h10096": "H100-96GB",
    "grandteton": "H100-96GB",
    "ascend": "910B",
    "ascend910b": "910B",
    "atlas800ta2": "910B",
    "h100sxm": "H100",
    "a100sxm": "A100",
}

# The share of peak a training step's hardware FLOPs reach (`step_efficiency`): where the HBM bandwidth is known,
# the matmuls at `gemm_efficiency` plus the element-wise work as bytes per matmul FLOP at that bandwidth, eager or
# compiled, both calibrated on meshformer's Llama 3.1 8B shape (8 layers, 2 x 8192 tokens) on one H200
# (docs/benchmarks.md, "Training on one H200": eager without recompute, compiled with selective recompute); the
# optimizer step is timed apart (planner/throughput.py). A slower memory (HBM2e) or a faster matmul unit leaves a
# larger share of the step to the element-wise work. Elsewhere (`efficiency`): the 910B's from MindSpore's published
# figure (graph mode), the CPU's measured. `runtime_bytes`: what that process held outside the
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

    def bare(n: str) -> str:
        return n.replace(" ", "").replace("-", "").replace("_", "").lower()

    key = bare(name)
    for k in ACCELERATORS:
        if key == bare(k):
            return ACCELERATORS[k]
    if key in ALIASES:
        return ACCELERATORS[ALIASES[key]]
    raise UserError(f"--accelerator {name!r}: one of {', '.join([*ACCELERATORS, 'cpu'])}")
