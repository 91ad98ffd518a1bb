"""backends/torch_private.py: every wrapper still reaches its private torch API on the installed torch, and does
what its caller relies on (an upgrade that moves one fails here, by name, before a run does). CHECKED_ON records the
release the wrappers were read against; any torch the project supports (pyproject.toml) must pass."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshformer.backends import torch_private as tp


def test_foreach_mul_scales_in_place():
    ts = [torch.ones(3), torch.full((2, 2), 2.0)]
    tp.foreach_mul_(ts, 0.5)
    assert ts[0].tolist() == [0.5] * 3 and ts[1].eq(1.0).all()


def test_fused_adamw_devices_include_the_cpu():
    assert {"cpu", "cuda"} <= set(tp.fused_optimizer_devices())


def test_fake_tensors_and_store():
    with tp.fake_tensor_mode()():
        t = torch.empty(1 << 40, dtype=torch.bfloat16)  # 2 TiB: only a shape
    assert t.shape == (1 << 40,) and t.dtype == torch.bfloat16
    assert tp.fake_store()() is not None
    assert callable(tp.replicate_with_fsdp())


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
def test_onednn_linear_is_f_linear():
    a, w, b = torch.randn(5, 8), torch.randn(3, 8), torch.randn(3)
    torch.testing.assert_close(tp.onednn_linear(a, w, b), F.linear(a, w, b))
    torch.testing.assert_close(tp.onednn_linear(a, w, None), a @ w.t())


def test_selective_recompute_ops():
    names = {op.__name__ for op in tp.functional_collective_ops()}
    assert names == {"all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_to_all_single"}
    attention = tp.attention_kernel_ops()
    assert len(attention) == 4 and all(op.__name__.startswith("_scaled_dot_product_") for op in attention)


def test_checkpoint_wrapper_and_tree_leaves():
    layer = nn.Linear(4, 4)
    wrapped = tp.checkpoint_wrapper(layer, preserve_rng_state=False)
    assert tp.is_checkpoint_wrapped(wrapped) and not tp.is_checkpoint_wrapped(layer)
    names = [n for n, _ in nn.Sequential(wrapped).named_parameters()]  # as a layer inside a model
    assert names == ["0._checkpoint_wrapped_module.weight", "0._checkpoint_wrapped_module.bias"]
    x = torch.randn(2, 4, requires_grad=True)
    wrapped(x).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None
    assert tp.tree_leaves((1, [2, {"a": 3}])) == [1, 2, 3]


def test_pipeline_and_memory_history_names_exist():
    sorted_p2p, wait_p2p = tp.pipeline_batch_p2p()
    assert callable(sorted_p2p) and callable(wait_p2p)
    kinds = tp.pipeline_computation_type()
    assert {"FORWARD", "FULL_BACKWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT"} <= set(kinds.__members__)
    # CUDA-only at run time; on this build the two names must still resolve, as the profile window calls them.
    assert callable(torch.cuda.memory._record_memory_history) and callable(torch.cuda.memory._dump_snapshot)


def test_tensor_views_and_dtensor_shards():
    w = torch.randn(4, 3)
    assert tp.view_base(w.t()) is w and tp.view_base(w) is w
    a, b, offs = torch.randn(6, 16), torch.randn(2, 16, 16), torch.tensor([2, 6], dtype=torch.int32)
    assert tp.grouped_mm_supported(a, b, b) and tp.grouped_mm_op() is torch.ops.aten._grouped_mm
    torch.testing.assert_close(tp.grouped_mm(a, b, offs), torch.cat([a[:2] @ b[0], a[2:] @ b[1]]))


# Needs a process group: the `fake` backend, in a process of its own so that this one keeps none.
FAKE_WORLD = """
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, schedules
from torch.distributed.tensor import Shard, distribute_tensor
from meshformer.backends import torch_private as tp

dist.init_process_group("fake", store=tp.fake_store()(), rank=0, world_size=2)
mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
assert tp.flatten_mesh(mesh, ("dp", "tp"), "dp_tp").size() == 2
shard = tp.dtensor_local(distribute_tensor(torch.randn(4, 4), mesh["dp"], [Shard(0)]))
assert type(shard) is torch.Tensor and shard.shape == (2, 4)
group = dist.group.WORLD
assert tp.all_gather_autograd(torch.randn(3, 4, requires_grad=True), 0, group).shape == (6, 4)
assert tp.all_to_all_autograd(torch.randn(4, 2), [2, 2], [2, 2], group).shape == (4, 2)
cpu = torch.device("cpu")
one = PipelineStage(torch.nn.Linear(2, 2), 0, 2, cpu)
assert tp.pipeline_schedule_stages(schedules.ScheduleGPipe(one, 2)) == [one]
first, third = (PipelineStage(torch.nn.Linear(2, 2), i, 4, cpu) for i in (0, 2))
assert tp.pipeline_schedule_stages(schedules.ScheduleInterleaved1F1B([first, third], 2)) == [first, third]
print("ok")
"""


def test_wrappers_that_need_a_process_group():
    """flatten_mesh, the autograd collectives, a DTensor's shard and a schedule's stages, on a fake 2-rank world."""
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(FAKE_WORLD)], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]
