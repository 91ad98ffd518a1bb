"""Every private torch API meshformer calls, each wrapped once, with the torch release it was checked on.

A private name can move or change between releases without notice. Calling it only from here means an upgrade
breaks one function with a clear name, not a dozen call sites; `tests/unit/test_private_api_scan.py` fails if a
private torch name, or an underscored attribute of a torch object (a schedule's `_stages`, a tensor's `_base`), is
used anywhere else under src/. Checked on torch 2.13.0 (CPU build); the GPU paths on the same release.
"""

from __future__ import annotations

import functools
import logging

import torch

CHECKED_ON = "2.13.0"


def flatten_mesh(mesh, dims: tuple[str, ...], name: str):
    """The sub-mesh of `dims` flattened into one dimension called `name` (DeviceMesh._flatten, torch 2.13.0).

    torchtitan builds its flattened batch/loss/fsdp meshes the same way; there is no public spelling yet."""
    sub = mesh[dims[0]] if len(dims) == 1 else mesh[dims]
    return sub._flatten(name)


def foreach_mul_(tensors: list[torch.Tensor], factor) -> None:
    """tensors[i] *= factor in one multi-tensor kernel (torch._foreach_mul_, torch 2.13.0)."""
    torch._foreach_mul_(tensors, factor)


def replicate_with_fsdp():
    """FSDP2's replicate (DDP on the FSDP2 machinery: mixed precision, DTensor gradients), from
    torch.distributed._composable.replicate_with_fsdp (torch 2.13.0)."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    return replicate


def fused_optimizer_devices() -> list[str]:
    """Device types that have torch's fused AdamW kernel (torch.utils._foreach_utils, torch 2.13.0)."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return list(_get_fused_kernels_supported_devices())


def fake_tensor_mode():
    """FakeTensorMode (torch._subclasses.fake_tensor, torch 2.13.0): tensors with shapes, dtypes and devices but
    no storage, so a model of any size is built and counted in milliseconds."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode


def fake_store():
    """The store of the `fake` process-group backend (torch.testing._internal.distributed.fake_pg, torch 2.13.0):
    a world of any size in one process, collectives that do nothing."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore


def onednn_linear(a: torch.Tensor, b_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """a @ b_t.T (+ bias) by oneDNN (torch.ops.mkldnn._linear_pointwise, torch 2.13.0)."""
    return torch.ops.mkldnn._linear_pointwise(a, b_t, bias, "none", [], "")


def functional_collective_ops() -> list:
    """The functional collectives' ops (torch.ops._c10d_functional, torch 2.13.0) whose outputs selective
    recompute keeps rather than communicating again."""
    ns = getattr(torch.ops, "_c10d_functional", None)
    names = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_to_all_single")
    return [getattr(ns, n) for n in names if ns is not None and hasattr(ns, n)]


def all_gather_autograd(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    """`t` of every rank of `group` concatenated along `dim`, differentiable: the backward reduce-scatters (sums)
    the gradient back to each rank's piece (torch.distributed._functional_collectives.all_gather_single_autograd,
    torch 2.13.0; works on gloo)."""
    from torch.distributed._functional_collectives import all_gather_single_autograd

    return all_gather_single_autograd(t, dim, group)


def all_to_all_autograd(t: torch.Tensor, output_split_sizes, input_split_sizes, group) -> torch.Tensor:
    """Rows of `t` scattered to the ranks of `group` by `input_split_sizes`, theirs received by
    `output_split_sizes`, differentiable: the backward sends the gradients back the same way
    (torch.distributed._functional_collectives.all_to_all_single_autograd, torch 2.13.0; works on gloo)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    return all_to_all_single_autograd(t, output_split_sizes, input_split_sizes, group)


def grouped_mm_op():
    """The aten op behind `grouped_mm` (torch.ops.aten._grouped_mm, torch 2.13.0), whose outputs selective
    recompute keeps."""
    return torch.ops.aten._grouped_mm


def attention_kernel_ops() -> list:
    """The aten ops behind F.scaled_dot_product_attention's kernels (torch.ops.aten._scaled_dot_product_*, torch
    2.13.0): the flash (CUDA and CPU), memory-efficient and cuDNN kernels, whose outputs selective recompute keeps."""
    aten = torch.ops.aten
    return [
        aten._scaled_dot_product_flash_attention,
        aten._scaled_dot_product_flash_attention_for_cpu,
        aten._scaled_dot_product_efficient_attention,
        aten._scaled_dot_product_cudnn_attention,
    ]


def softmax_op():
    """The aten op behind torch.softmax (torch.ops.aten._softmax.default, torch 2.13.0): what a selective checkpoint
    policy sees a softmax as."""
    return torch.ops.aten._softmax.default


SELECTIVE_CHECKPOINT_NOTICE = "context_fn is passed to torch.utils.checkpoint under torch.compile"


class _DropSelectiveCheckpointNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return SELECTIVE_CHECKPOINT_NOTICE not in record.getMessage()


@functools.cache
def quiet_selective_checkpoint_notice() -> None:
    """Drop the notice torch.compile logs once a process when it meets a selective checkpoint
    (torch._higher_order_ops.wrap's logger, torch 2.13.0: "Detected that context_fn is passed to
    torch.utils.checkpoint under torch.compile. Please make sure the checkpointed region does not contain in-place
    ops"). meshformer's selective regions (parallel/recompute.py, backends/cpu_attention.py) run no in-place op,
    and in a run's log the notice reads as a fault. Every other record of that logger passes."""
    logging.getLogger("torch._higher_order_ops.wrap").addFilter(_DropSelectiveCheckpointNotice())


def checkpoint_wrapper(module: torch.nn.Module, **kwargs) -> torch.nn.Module:
    """`module` under non-reentrant activation checkpointing; inside a model its parameter names gain
    `_checkpoint_wrapped_module.` (torch.distributed.algorithms._checkpoint.checkpoint_wrapper, torch 2.13.0;
    torchtitan wraps its layers the same way)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as wrap

    return wrap(module, **kwargs)


def is_checkpoint_wrapped(module: torch.nn.Module) -> bool:
    """Whether `module` is one `checkpoint_wrapper` returned (its CheckpointWrapper class, torch 2.13.0)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return isinstance(module, CheckpointWrapper)


def tree_leaves(tree) -> list:
    """The leaves of a nested tuple / list / dict (torch.utils._pytree.tree_leaves, torch 2.13.0: no public
    pytree module yet)."""
    from torch.utils import _pytree

    return _pytree.tree_leaves(tree)


def record_cuda_memory_history(max_entries: int | None) -> None:
    """Start recording CUDA allocations for a memory snapshot, `max_entries` at most; None stops recording
    (torch.cuda.memory._record_memory_history, torch 2.13.0: the documented way, still underscored)."""
    if max_entries is None:
        torch.cuda.memory._record_memory_history(enabled=None)
    else:
        torch.cuda.memory._record_memory_history(max_entries=max_entries)


def dump_cuda_memory_snapshot(path: str) -> None:
    """Write the recorded CUDA memory history to `path`, for pytorch.org/memory_viz
    (torch.cuda.memory._dump_snapshot, torch 2.13.0)."""
    torch.cuda.memory._dump_snapshot(path)


def pipeline_batch_p2p():
    """(sorted_batch_p2p, wait_batch_p2p): a pipeline stage's send/recv ops issued in one batch, and the wait for
    them (torch.distributed.pipelining.schedules._sorted_batch_p2p / _wait_batch_p2p, torch 2.13.0)."""
    from torch.distributed.pipelining.schedules import _sorted_batch_p2p, _wait_batch_p2p

    return _sorted_batch_p2p, _wait_batch_p2p


def pipeline_computation_type():
    """The enum of a pipeline schedule's action kinds, F, B, I, W, ... (torch.distributed.pipelining.schedules.
    _ComputationType, torch 2.13.0)."""
    from torch.distributed.pipelining.schedules import _ComputationType

    return _ComputationType


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Row groups of `a` [rows, k] times their own matrix of `b` [groups, k, n]: group g is rows offs[g-1]..offs[g]
    (torch._grouped_mm, torch 2.13.0). Its backward refuses a gradient with zero strides (the expanded gradient of a
    sum), so the gradient is made contiguous first; rows past offs[-1] get no defined gradient, so callers pass
    exactly offs[-1] rows. Under torch.compile only bf16 is traced: the op's fake-tensor rule refuses fp32 (the
    eager CPU kernel runs it), so an fp32 call runs eagerly, a graph break."""
    if a.dtype != torch.bfloat16 and torch.compiler.is_compiling():
        return _eager_grouped_mm(a, b, offs)
    return _grouped_mm(a, b, offs)


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    out = torch._grouped_mm(a, b, offs=offs)
    if out.requires_grad:
        out.register_hook(lambda g: g.contiguous())
    return out


_eager_grouped_mm = torch.compiler.disable(_grouped_mm)


def grouped_mm_supported(x: torch.Tensor, gate: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether torch._grouped_mm runs these expert shapes here (torch 2.13.0): fp32/bf16 (fp16 is refused on CPU),
    every matrix's row stride 16-byte aligned (the CPU kernel requires it), and a CUDA device of compute capability
    8.0 or more for bf16 (9.0 for fp32)."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        return False
    size = x.element_size()
    if (gate.shape[-1] * size) % 16 or (down.shape[-1] * size) % 16 or (gate.shape[-2] * size) % 16:
        return False
    if x.device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(x.device)
        return major >= (8 if x.dtype == torch.bfloat16 else 9)
    return x.device.type == "cpu"


def pipeline_schedule_stages(sched) -> list:
    """The stages a pipeline schedule runs on this rank: a multi-stage schedule's list, a single-stage schedule's
    one (torch.distributed.pipelining.schedules' `_stages` / `_stage`, torch 2.13.0: no public accessor)."""
    return list(getattr(sched, "_stages", None) or [sched._stage])


def view_base(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage `t` views, or `t` itself when it is not a view (Tensor._base, torch 2.13.0)."""
    return t._base if t._base is not None else t


def dtensor_local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard as it is stored, outside autograd (DTensor._local_tensor, torch 2.13.0); any other
    tensor itself."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def dispatch_mode_base() -> type:
    """The base class of a mode that sees every aten operation run under it (torch.utils._python_dispatch.
    TorchDispatchMode, torch 2.13.0: no public name)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def tp_style_output_fn(style: type):
    """The static function a tensor-parallel style applies to its module's output
    (ParallelStyle._prepare_output_fn of ColwiseParallel / RowwiseParallel, torch 2.13.0): parallel/float8.py gives
    torchao's FP8 styles the plain styles' output step for a linear with a bias."""
    return style._prepare_output_fn
