"""The parallel layout as plain numbers (ParallelDims), for every layout the parity suite runs: no processes.

Under torchrun, `init_parallel` checks that torch's DeviceMesh put each rank where `ParallelDims.coords` says
(every parity launch exercises that); here the arithmetic itself is checked against the layout's definition.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist"))
import harness  # noqa: E402
from meshformer.errors import UserError  # noqa: E402
from meshformer.parallel.dims import MESH_DIMS, ParallelDims, shard_degree  # noqa: E402

P = harness.P


def dims_of(case: str) -> tuple[ParallelDims, dict]:
    overrides = harness.CASES[case][0]
    cfg = harness.make_cfg(overrides)
    return ParallelDims.from_config(cfg, harness.world_of(case)), overrides


@pytest.mark.parametrize("case", sorted(harness.CASES))
def test_degrees_and_mesh_shape_follow_parallel_config(case):
    d, o = dims_of(case)
    dp, tp, pp = o.get(P + "data_parallel", 1), o.get(P + "model_parallel", 1), o.get(P + "pipeline_stage", 1)
    sharded = o.get(P + "optimizer_shard") or o.get("parallel.enable_parallel_optimizer")
    shard = o.get("optimizer.optimizer_parallel") or (dp if sharded else 1)
    assert d.mesh_shape == (pp, dp // shard, shard, 1, tp)  # cp: 1 until context parallelism runs
    assert (d.world_size, d.dp, d.tp, d.pp, d.dp_shard, d.cp, d.ep) == (dp * tp * pp, dp, tp, pp, shard, 1, 1)
    assert d.sharded == (shard > 1)
    assert d.enabled == {
        "pp": pp > 1, "dp_replicate": dp // shard > 1, "dp_shard": shard > 1, "cp": False, "tp": tp > 1,
        "ep": False, "etp": False,
    }  # fmt: skip
    v_schedule = o.get(P + "pipeline_schedule") in ("zbv_zero_bubble", "dualpipev")
    assert d.last_stage_pp_rank == (0 if v_schedule else pp - 1)


@pytest.mark.parametrize("case", sorted(harness.CASES))
def test_every_rank_has_one_place_and_groups_partition_the_world(case):
    d, _ = dims_of(case)
    world = d.world_size
    seen = set()
    for r in range(world):
        c = d.coords(r)
        row_major = 0
        for n, size in zip(MESH_DIMS, d.mesh_shape):
            row_major = row_major * size + c[n]
        assert row_major == r  # as init_device_mesh lays ranks out
        assert all(0 <= c[n] < size for n, size in zip(MESH_DIMS, d.mesh_shape))
        assert 0 <= c["dp"] < d.dp and c["dp"] == c["dp_replicate"] * d.dp_shard + c["dp_shard"]
        seen.add(tuple(c[n] for n in MESH_DIMS))
    assert len(seen) == world
    for dim, size in [*zip(MESH_DIMS, d.mesh_shape), ("dp", d.dp)]:
        groups = d.groups(dim)
        assert sorted(r for g in groups for r in g) == list(range(world)), dim
        assert all(len(g) == size for g in groups) and len(groups) == world // size, dim
        varying = ("dp_replicate", "dp_shard") if dim == "dp" else (dim,)
        fixed = [n for n in MESH_DIMS if n not in varying]
        for g in groups:  # members differ only in this dim, listed in order of its coordinate
            assert len({tuple(d.coords(r)[n] for n in fixed) for r in g}) == 1, (dim, g)
            assert [d.coords(r)[dim] for r in g] == list(range(size)), (dim, g)
    # Tensor parallel is innermost: its groups are runs of neighbouring ranks (same node, fastest links).
    assert all(g == list(range(g[0], g[0] + d.tp)) for g in d.groups("tp"))
    # Pipeline is outermost: stage s holds the contiguous block of ranks [s * world/pp, (s+1) * world/pp).
    assert [d.coords(r)["pp"] for r in range(world)] == [r * d.pp // world for r in range(world)]


@pytest.mark.parametrize("case", sorted(harness.CASES))
def test_exactly_one_metrics_rank_on_the_last_stage(case):
    d, _ = dims_of(case)
    ranks = [r for r in range(d.world_size) if d.is_metrics_rank(r)]
    assert len(ranks) == 1
    c = d.coords(ranks[0])
    assert (c["pp"], c["dp"], c["tp"]) == (d.last_stage_pp_rank, 0, 0)


def test_hsdp_splits_data_parallel_into_replicas_of_shard_groups():
    d, _ = dims_of("hsdp2x2_rc")
    assert (d.dp_replicate, d.dp_shard) == (2, 2)
    assert d.groups("dp_shard") == [[0, 1], [2, 3]] and d.groups("dp_replicate") == [[0, 2], [1, 3]]
    assert d.groups("dp") == [[0, 1, 2, 3]]


def test_eight_rank_layout_by_hand():
    d, _ = dims_of("dp2xtp2xpp2")
    # ranks 0-3: stage 0; within a stage, tp pairs (0,1), (2,3); dp pairs (0,2), (1,3)
    assert d.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert d.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert d.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert d.coords(6) == {"pp": 1, "dp_replicate": 1, "dp_shard": 0, "cp": 0, "tp": 0, "dp": 1}
    assert [r for r in range(8) if d.is_metrics_rank(r)] == [4]


def test_each_mesh_dim_is_one_field():
    names = [f.name for f in dataclasses.fields(ParallelDims)]
    assert names[: len(MESH_DIMS)] == list(MESH_DIMS)
    assert math.prod(ParallelDims().mesh_shape) == 1 and ParallelDims().describe() == "single process"


def test_layout_errors_need_no_process_group():
    cfg = harness.make_cfg({P + "data_parallel": 2, P + "model_parallel": 2})
    with pytest.raises(UserError, match=r"2x2x1 = 4 but 8 processes were started: use e\.g\. "):
        ParallelDims.from_config(cfg, 8)
    cfg = harness.make_cfg(
        {
            P + "model_parallel": 2,
            P + "pipeline_stage": 2,
            P + "micro_batch_num": 4,
            "model.model_config.tie_word_embeddings": True,
        }
    )
    with pytest.raises(UserError, match="tie_word_embeddings=true cannot be split by pipeline_stage=2"):
        ParallelDims.from_config(cfg, 4)  # a run-only rule, also checked before any process group
    assert shard_degree(harness.make_cfg({P + "data_parallel": 4, P + "optimizer_shard": True})) == 4
    with pytest.raises(ValueError):
        ParallelDims(tp=0)
    with pytest.raises(ValueError):
        ParallelDims(pp=2).coords(2)
