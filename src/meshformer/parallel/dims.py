"""The parallel layout as plain numbers: degrees, mesh shape and every rank's coordinates, with no process group.

`ParallelDims.from_config(cfg, world_size)` validates `parallel_config` against the model and the world size
(one line, exit code 2, before anything is launched) and answers every layout question: which mesh dims exist
and which are enabled, the mesh shape, a rank's coordinate in each dim, the ranks of each group, which rank
logs. `parallel/env.py` builds the runtime (process group, DeviceMesh) from it and checks that torch's mesh
agrees; `meshformer plan`, tests and the trainer's batch arithmetic use it without any process.

Mesh dims, outermost first: ("pp", "dp_replicate", "dp_shard", "tp"). Tensor parallel is innermost so its ranks
are neighbours (same node, fastest links: it communicates every layer); pipeline is outermost (it only sends
activations between stages, so it tolerates slow links between nodes). Data parallel sits between and is split
in two for optimizer sharding: `dp_shard` ranks shard parameters/gradients/optimizer states (FSDP) and
`dp_replicate` ranks hold copies (HSDP); without sharding dp_shard is 1. The flattened `dp` dim
(dp_replicate x dp_shard) is the data-parallel group that sums token counts and losses.

A new dimension (context parallel "cp", expert parallel "ep") is one field here, one name in MESH_DIMS at its
place in the nesting order, and one `apply_*` function in parallel/; rank arithmetic stays in this file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshformer.config.schema import MeshformerConfig
from meshformer.config.validate import V_SCHEDULES, validate_run

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


def shard_degree(cfg: MeshformerConfig) -> int:
    """Size of the optimizer-shard (FSDP) group; 1 means plain replicated data parallel (DDP)."""
    pc = cfg.parallel_config
    op = cfg.optimizer.optimizer_parallel
    if op > 0:
        return op
    if pc.optimizer_shard or cfg.parallel.enable_parallel_optimizer:
        return pc.data_parallel
    return 1


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of every mesh dim (field names = MESH_DIMS) plus where the last pipeline stage sits."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    last_stage_pp_rank: int = 0  # pp coordinate of the rank holding the last stage (0 under V schedules)

    def __post_init__(self) -> None:
        for name in MESH_DIMS:
            if getattr(self, name) < 1:
                raise ValueError(f"ParallelDims.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.last_stage_pp_rank < self.pp:
            raise ValueError(f"last_stage_pp_rank={self.last_stage_pp_rank} outside pp={self.pp}")

    @classmethod
    def from_config(cls, cfg: MeshformerConfig, world_size: int) -> "ParallelDims":
        """Validate the layout for `world_size` processes (UserError naming the fix) and return its dims."""
        validate_run(cfg, world_size)
        pc = cfg.parallel_config
        shard = shard_degree(cfg)
        pp = pc.pipeline_stage
        return cls(
            pp=pp,
            dp_replicate=pc.data_parallel // shard,
            dp_shard=shard,
            tp=pc.model_parallel,
            last_stage_pp_rank=0 if pc.pipeline_schedule in V_SCHEDULES else pp - 1,
        )

    # ---- shape --------------------------------------------------------------------------------------------
    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, n) for n in MESH_DIMS)

    @property
    def world_size(self) -> int:
        return math.prod(self.mesh_shape)

    @property
    def dp(self) -> int:
        """Data-parallel degree: replicas x shards (the ranks that read different samples)."""
        return self.dp_replicate * self.dp_shard

    @property
    def enabled(self) -> dict[str, bool]:
        """Which dims split anything (size > 1); a size-1 dim exists in the mesh but costs no communication."""
        return {n: getattr(self, n) > 1 for n in MESH_DIMS}

    @property
    def sharded(self) -> bool:
        """Parameters, gradients and optimizer states sharded over dp_shard (FSDP / HSDP)."""
        return self.dp_shard > 1

    def describe(self) -> str:
        parts = [f"{n}{getattr(self, n)}" for n in MESH_DIMS if getattr(self, n) > 1]
        return "x".join(parts) or "single process"

    # ---- ranks --------------------------------------------------------------------------------------------
    def coords(self, rank: int) -> dict[str, int]:
        """Coordinate of `rank` in every mesh dim (row-major over MESH_DIMS, as init_device_mesh lays ranks out),
        plus the flattened data-parallel index "dp"."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world size {self.world_size}")
        out, rest = {}, rank
        for name, size in reversed(list(zip(MESH_DIMS, self.mesh_shape))):
            rest, out[name] = divmod(rest, size)
        out = {n: out[n] for n in MESH_DIMS}
        out["dp"] = out["dp_replicate"] * self.dp_shard + out["dp_shard"]
        return out

    def rank_of(self, **coords: int) -> int:
        """The rank at the given mesh coordinates (missing dims: 0)."""
        rank = 0
        for name, size in zip(MESH_DIMS, self.mesh_shape):
            rank = rank * size + coords.get(name, 0)
        return rank

    def groups(self, dim: str) -> list[list[int]]:
        """The rank groups of one dim ("pp", "dp_replicate", "dp_shard", "tp", or the flattened "dp"): ranks that
        differ only in that dim's coordinate, each group in coordinate order."""
        names = ("dp_replicate", "dp_shard") if dim == "dp" else (dim,)
        if not set(names) <= set(MESH_DIMS):
            raise ValueError(f"unknown mesh dim {dim!r}: one of {', '.join(MESH_DIMS)}, dp")
        found: dict[tuple, list[int]] = {}
        for r in range(self.world_size):
            c = self.coords(r)
            key = tuple(c[n] for n in MESH_DIMS if n not in names)
            found.setdefault(key, []).append(r)
        return list(found.values())

    def is_metrics_rank(self, rank: int) -> bool:
        """The rank that logs and writes metrics: last pipeline stage, first data-parallel and tensor rank."""
        c = self.coords(rank)
        return c["pp"] == self.last_stage_pp_rank and c["dp"] == 0 and c["tp"] == 0
