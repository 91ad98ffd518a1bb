"""The CPU backend: the tuning a CPU run gets, kept out of the model, parallel and training code.

- oneDNN linears (`cpu_matmul`): fp32 linear layers through oneDNN on CPUs where torch's BLAS takes a slow path.
- Host memory (`retain_host_memory`): glibc malloc settings, so the host memory a CPU training step frees stays in
  the process instead of being page-faulted back every step.
- CPU features: the vendor and the AVX-512 / AVX-512 BF16 / AMX flags that `cpu_matmul: auto` and MFU's peak
  (train/metrics.py) go by, read in one place.

The models stay plain nn.Modules: `apply_cpu_matmul` swaps their linears' class at build time. Private torch APIs
are called through backends/torch_private.py only.

oneDNN linears
--------------
torch runs an fp32 `F.linear` on a CPU through its BLAS, MKL. On CPUs not made by Intel MKL dispatches its AVX2
kernels even where the CPU has AVX-512, and oneDNN's AVX-512 brgemm kernels, which ship inside torch, run the
model's shapes about twice as fast (docs/benchmarks.md, "fp32 linears on oneDNN"). bf16 matmuls already go to
oneDNN; fp32 ones only when asked, which is what this module does.

`use_onednn_linears` gives every `nn.Linear` of a (meta-device) model the forward of `OneDNNLinear`, a subclass with
no parameters or buffers of its own: parameter names, checkpoints and `isinstance(m, nn.Linear)` stay as they were.
Its forward calls oneDNN only for plain fp32 CPU tensors outside autocast; anything else (bf16 autocast, DTensor
weights under tensor parallelism, another device) takes `F.linear` unchanged. The three matmuls of a linear's forward
and backward go through one custom op (`meshformer::onednn_mm`) so that Inductor calls it as an opaque kernel (its
own lowering of oneDNN's linear asserts on trainable weights) and selective recompute can keep its outputs.

Under `cpu_matmul: auto` a call of fewer than AUTO_MIN_MACS multiply-adds (a tiny model, a decoding step) keeps
F.linear, where oneDNN's fixed cost per call outweighs its faster kernel; `onednn` sends every call.

Results differ from MKL's by the order of accumulation only (a few ulps); the weight-gradient matmul picks which
operand oneDNN copies to a contiguous layout by size (the smaller one, the faster order on every model shape),
and small weights keep MKL there, where the copy costs more than the kernel saves (docs/benchmarks.md).

Host memory
-----------
A step frees and re-allocates the same activation, gradient and logits buffers every time. glibc's malloc hands
large blocks back to the kernel: blocks above its mmap threshold are unmapped on free, and the heap's top is
trimmed once more than its trim threshold lies free there. The next step touches that memory again, and every
4 KiB page costs a fault and a zero-fill: tens of thousands a step on the benchmark model, a few percent of its
step time (docs/benchmarks.md, "Rotary and host memory").

What changes, and why no more:
- the heap's top is never trimmed (`M_TRIM_THRESHOLD` = SIZE_MAX: mallopt's int -1 becomes glibc's size_t), so
  freed memory stays resident and is reused. The heap stops shrinking between steps but grows no further than a
  step's peak needs (the benchmark model's peak RSS is the same with and without: docs/benchmarks.md);
- the mmap threshold is fixed at 32 MiB, glibc's own ceiling for it (its dynamic threshold climbs there once
  such blocks are freed): larger blocks come from the retained top when it has room, else they are mapped as
  before, never by growing the heap;
- `M_TOP_PAD` (256 MiB) grows the heap in larger steps, so a step's blocks above the threshold (its logits and
  their gradients) find room in the top instead of being mapped afresh; untouched pad costs no memory.
Mapping everything from the heap (`M_MMAP_MAX` = 0) also removed the faults, but it is not safe on glibc 2.36:
torch allocates with 64-byte `posix_memalign`, which asks for 96 bytes more than a freed block of the same size
holds, so a block freed behind a small live allocation is never reused and the heap grows every step (a large
block freed behind a small one: tests/unit/test_host_memory.py checks these settings stay flat where that one grew;
docs/benchmarks.md has the figures).
This is what torch's CPU tuning guide gets from preloading jemalloc or tcmalloc, without another allocator or a
relaunch. C libraries other than glibc are left alone.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from meshformer.backends import torch_private

# `cpu_matmul: auto` leaves a linear with fewer multiply-adds per call than this to F.linear: oneDNN's fixed cost
# per call outweighs its faster kernel there; 4M sits between the shapes where MKL wins and where oneDNN does
# (docs/benchmarks.md, "fp32 linears on oneDNN": `AUTO_MIN_MACS`).
AUTO_MIN_MACS = 1 << 22

# Below this many weight elements the weight-gradient matmul stays with torch's BLAS: oneDNN's transposed-input copy
# then costs more than its kernel saves (docs/benchmarks.md, "fp32 linears on oneDNN": the weight gradient).
_MIN_DW_ELEMENTS = 256 * 256


@torch.library.custom_op("meshformer::onednn_mm", mutates_args=())
def onednn_mm(a: torch.Tensor, b_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b_t.T (+ bias) by oneDNN: a [m, k], b_t [n, k] in any strides (a is copied if not row-major)."""
    return torch_private.onednn_linear(a, b_t, bias)


@onednn_mm.register_fake
def _(a, b_t, bias=None):
    return a.new_empty(a.shape[0], b_t.shape[0])


class _OneDNNLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # Only what backward will use, as F.linear's autograd saves: x for the weight gradient, the weight for x's
        # (a frozen base weight under LoRA keeps no input alive).
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight if ctx.needs_input_grad[0] else None)
        ctx.x_shape, ctx.w_shape = x.shape, weight.shape
        ctx.has_bias = bias is not None
        return onednn_mm(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight = ctx.saved_tensors
        out_f, in_f = ctx.w_shape
        dy2 = dy.reshape(-1, out_f)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = onednn_mm(dy2, weight.t()).view(ctx.x_shape)  # dy @ W
        if ctx.needs_input_grad[1]:
            dw = weight_grad(dy2, x.reshape(-1, in_f))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        return dx, dw, db


def weight_grad(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dW = dy^T x for dy [tokens, out], x [tokens, in]: both operands are transposed here, and oneDNN copies its
    first to row-major, so the smaller one goes first (the faster order on every model shape: docs/benchmarks.md)."""
    out_f, in_f = dy.shape[1], x.shape[1]
    if out_f * in_f < _MIN_DW_ELEMENTS:
        return dy.t() @ x
    if out_f > in_f:  # copy x, compute dW^T = x^T dy, transpose the weight-sized result
        return onednn_mm(x.t(), dy.t()).t().contiguous()
    return onednn_mm(dy.t(), x.t())  # copy dy, compute dW directly


def _plain(t: torch.Tensor) -> bool:
    return type(t) is torch.Tensor or type(t) is nn.Parameter


def onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, min_macs: int = 0
) -> torch.Tensor:
    """F.linear, by oneDNN for plain fp32 CPU tensors outside autocast and calls of at least `min_macs`
    multiply-adds; by F.linear itself otherwise."""
    if (
        x.numel() * weight.shape[0] >= max(min_macs, 1)
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and _plain(x)
        and _plain(weight)
        and (bias is None or (_plain(bias) and bias.dtype == torch.float32))
        and not torch.is_autocast_enabled("cpu")
    ):
        return _OneDNNLinearFn.apply(x, weight, bias)
    return F.linear(x, weight, bias)


class OneDNNLinear(nn.Linear):
    """nn.Linear whose fp32 CPU forward and backward run on oneDNN (no parameters or buffers of its own; see the
    module's doc). `onednn_min_macs`: smaller calls take F.linear."""

    onednn_min_macs = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return onednn_linear(x, self.weight, self.bias, self.onednn_min_macs)


def use_onednn_linears(model: nn.Module, min_macs: int = 0) -> None:
    """Give every plain nn.Linear of `model` OneDNNLinear's forward, and a tied output projection
    (`tied_head_linear`, models/llama/model.py) onednn_linear, in place, for calls of at least `min_macs`
    multiply-adds."""
    for m in model.modules():
        if type(m) is nn.Linear:
            m.__class__ = OneDNNLinear
            m.onednn_min_macs = min_macs
        elif hasattr(m, "tied_head_linear"):
            m.tied_head_linear = functools.partial(onednn_linear, min_macs=min_macs)


def onednn_linear_decision(
    setting: str, device: torch.device, compute_dtype: torch.dtype, split_backward: bool = False
) -> tuple[bool, str]:
    """(use oneDNN for fp32 linears?, why) for `cpu_matmul`: onednn and blas are obeyed on a CPU; auto picks oneDNN
    where MKL is known to leave AVX-512 unused (an AVX-512 CPU not made by Intel) and the layers compute in fp32 (bf16
    already runs on oneDNN). Deterministic per machine, so a resumed run continues with the same kernels.
    `split_backward` (a zero-bubble pipeline schedule) keeps BLAS: torch splits each backward into input and weight
    halves by autograd node, and the one node of a oneDNN linear computes both halves each time."""
    if device.type != "cpu":
        return False, ""
    if not torch.backends.mkldnn.is_available():
        return False, "cpu_matmul: blas (this torch has no oneDNN)"
    if split_backward and setting != "blas":
        return False, f"cpu_matmul: {setting} -> blas (the pipeline schedule splits backward per autograd node)"
    if setting != "auto":
        return setting == "onednn", f"cpu_matmul: {setting}"
    if compute_dtype != torch.float32:
        return False, "cpu_matmul: auto -> blas (bf16 matmuls already run on oneDNN)"
    vendor, flags = cpu_vendor_and_flags()
    if "avx512f" not in flags:
        return False, "cpu_matmul: auto -> blas (no AVX-512: oneDNN is not proven faster here)"
    if vendor == "GenuineIntel":
        return False, "cpu_matmul: auto -> blas (MKL runs its AVX-512 kernels on Intel CPUs)"
    return True, f"cpu_matmul: auto -> onednn ({vendor or 'unknown vendor'} with AVX-512: MKL would run AVX2 kernels)"


def apply_cpu_matmul(model: nn.Module, setting: str, device: torch.device, compute_dtype: torch.dtype,
                     split_backward: bool = False) -> str:  # fmt: skip
    """`cpu_matmul` on a (meta-device) model, as training and inference build it: swaps its linears where
    `onednn_linear_decision` says so (auto: for calls of at least AUTO_MIN_MACS); returns the decision's note."""
    onednn, note = onednn_linear_decision(setting, device, compute_dtype, split_backward)
    if onednn:
        use_onednn_linears(model, AUTO_MIN_MACS if setting == "auto" else 0)
    return note


# ---------------------------------------------------------------- host memory

# <malloc.h>
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit

RETAINED = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX), (M_TRIM_THRESHOLD, -1), (M_TOP_PAD, 256 << 20))
# What a process that never tuned malloc runs with, near enough: glibc's dynamic mmap threshold climbs to the
# largest mapped block freed (at most 32 MiB), its trim threshold to twice that, and the pad stays 128 KiB. A
# benchmark sets it for the side that stands for such a process (bench/bench_vs_hf.py's Hugging Face side;
# docs/benchmarks.md compares its page faults with an untuned process's).
GLIBC_SETTLED = (
    (M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX),
    (M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD_MAX),
    (M_TOP_PAD, 128 << 10),
)


def glibc():
    """The process's C library when it is glibc, else None."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it; musl and macOS give mallopt other meanings
        return libc
    except (OSError, AttributeError):
        return None


def set_malloc(settings: tuple[tuple[int, int], ...]) -> bool:
    """Apply (mallopt parameter, value) pairs; False where the C library is not glibc or refused one."""
    libc = glibc()
    return libc is not None and all(libc.mallopt(param, value) == 1 for param, value in settings)


@functools.cache
def retain_freed_host_memory() -> bool:
    """Tune glibc's malloc for this process (once); False where the C library is not glibc or refused a setting."""
    return set_malloc(RETAINED)


# ---------------------------------------------------------------- CPU features


def cpu_vendor_and_flags() -> tuple[str, set[str]]:
    """(vendor_id, flags) of /proc/cpuinfo's first processor; ("", set()) where it cannot be read."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "", set()
    field = {}
    for ln in lines:
        key, _, val = ln.partition(":")
        field.setdefault(key.strip(), val.strip())
    return field.get("vendor_id", ""), set(field.get("flags", "").split())


def cpu_has_bf16() -> bool:
    """Whether this CPU has bf16 matmul instructions (AVX-512 BF16 or AMX)."""
    _, flags = cpu_vendor_and_flags()
    if not flags:
        return True  # unknown: time bf16 itself
    return "avx512_bf16" in flags or "amx_bf16" in flags
