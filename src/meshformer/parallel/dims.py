"""The parallel layout as plain numbers: degrees, named meshes and every rank's coordinates, with no process group.

`ParallelDims.from_config(cfg, world_size)` validates `parallel_config` against the model and the world size
(one line, exit code 2, before anything is launched) and answers every layout question: which dims exist and
which are enabled, the mesh shapes, a rank's coordinate in each named mesh, the ranks of each group, which rank
logs. `parallel/env.py` builds the runtime (process group, DeviceMesh) from it and checks that torch's mesh
agrees; `meshformer plan`, tests and the trainer's batch arithmetic use it without any process.

The dense mesh, outermost first: MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp"), torchtitan's
nesting. Tensor parallel is innermost so its ranks are neighbours (same node, fastest links: it communicates
every layer); context parallel next to it (it exchanges keys and values every attention layer); pipeline is
outermost (it only sends activations between stages, so it tolerates slow links between nodes). Data parallel
sits between and is split in two for optimizer sharding: `dp_shard` ranks shard parameters/gradients/optimizer
states (FSDP) and `dp_replicate` ranks hold copies (HSDP); without sharding dp_shard is 1.

Named meshes are the groups a technique communicates over, each a product of dims (NAMED_MESHES):
"batch" (dp_replicate x dp_shard: ranks reading different samples; the legacy name "dp"), "loss"
(dp_replicate x dp_shard x cp: where token counts and losses are summed and gradients averaged), "fsdp"
(dp_shard x cp: parameter sharding; cp ranks need the same weights), and every single dim.

Routed experts see the same ranks through a second shape, EXPERT_MESH_DIMS = ("pp", "dp_replicate", "efsdp",
"ep", "etp") (torchtitan's sparse mesh): `ep` ranks split one MoE layer's experts and are borrowed from the
dense dp_shard x cp x tp ranks (from dp_shard x cp only when etp = tp), and `efsdp` shards the experts by FSDP
over what ep leaves, so efsdp x ep x etp = dp_shard x cp x tp. A configured run sets etp = tp under expert
parallelism (`from_config`): the ranks of one etp group see the same tokens and hold the same experts, whole
(parallel/expert_parallel.py), so ep never splits a tensor-parallel group's tokens.

A new dimension is one field here, one name in MESH_DIMS (or EXPERT_MESH_DIMS) at its place in the nesting, and
the named meshes that include it in NAMED_MESHES; rank arithmetic stays in this file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshformer.config.schema import MeshformerConfig
from meshformer.config.validate import V_SCHEDULES, shard_degree, validate_run
from meshformer.errors import UserError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
EXPERT_MESH_DIMS = ("pp", "dp_replicate", "efsdp", "ep", "etp")

# name -> (the mesh shape it lives in, the dims its groups span, in nesting order). Ranks in one group differ
# only in those dims; a rank's coordinate in the named mesh is row-major over them.
NAMED_MESHES: dict[str, tuple[str, tuple[str, ...]]] = {
    **{n: ("dense", (n,)) for n in MESH_DIMS},
    "batch": ("dense", ("dp_replicate", "dp_shard")),
    "dp": ("dense", ("dp_replicate", "dp_shard")),  # the batch mesh's older name (coords()["dp"], groups("dp"))
    "loss": ("dense", ("dp_replicate", "dp_shard", "cp")),
    "fsdp": ("dense", ("dp_shard", "cp")),
    "efsdp": ("expert", ("efsdp",)),
    "ep": ("expert", ("ep",)),
    "etp": ("expert", ("etp",)),
}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of every dim (first fields = MESH_DIMS, then the expert dims) plus where the last stage sits."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1  # ranks one MoE layer's experts are split over, borrowed from dp_shard x cp (x tp)
    etp: int = 1  # tensor parallel inside an expert: 1 (ep borrows the tp ranks too) or tp
    last_stage_pp_rank: int = 0  # pp coordinate of the rank holding the last stage (0 under V schedules)

    def __post_init__(self) -> None:
        for name in (*MESH_DIMS, "ep", "etp"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"ParallelDims.{name}={getattr(self, name)!r}: every degree is an integer >= 1")
        if self.etp not in (1, self.tp):
            raise ValueError(
                f"ParallelDims.etp={self.etp}: expert tensor parallel must be 1 (ep borrows the tp ranks) or "
                f"tp={self.tp} (experts split like the dense layers)"
            )
        borrowed, names = self.ep_borrows
        if borrowed % self.ep:
            raise ValueError(
                f"ParallelDims.ep={self.ep} must divide the ranks it borrows, {' x '.join(names)} = {borrowed}: "
                f"choose ep from {_divisors(borrowed)}"
            )
        if not 0 <= self.last_stage_pp_rank < self.pp:
            raise ValueError(f"last_stage_pp_rank={self.last_stage_pp_rank} outside pp={self.pp}")

    @classmethod
    def for_world(cls, world_size: int, **degrees: int) -> "ParallelDims":
        """The dims of `degrees`, refused (ValueError, one line) unless they multiply to `world_size`."""
        dims = cls(**degrees)
        if dims.world_size != world_size:
            shape = "x".join(map(str, dims.mesh_shape))
            raise ValueError(
                f"ParallelDims: pp x dp_replicate x dp_shard x cp x tp = {shape} = {dims.world_size} but "
                f"world_size={world_size}: pick degrees whose product is the number of processes"
            )
        return dims

    @classmethod
    def from_config(cls, cfg: MeshformerConfig, world_size: int) -> "ParallelDims":
        """Validate the layout for `world_size` processes (UserError naming the fix) and return its dims."""
        validate_run(cfg, world_size)
        pc = cfg.parallel_config
        shard = shard_degree(cfg)
        pp = pc.pipeline_stage
        try:
            return cls.for_world(
                world_size,
                pp=pp,
                dp_replicate=pc.data_parallel // shard,
                dp_shard=shard,
                cp=pc.context_parallel,
                tp=pc.model_parallel,
                ep=pc.expert_parallel,
                # Routed experts stay whole on every tensor-parallel rank (etp = tp): ep borrows dp_shard x cp only.
                etp=pc.model_parallel if pc.expert_parallel > 1 else 1,
                last_stage_pp_rank=0 if pc.pipeline_schedule in V_SCHEDULES else pp - 1,
            )
        except ValueError as e:  # validate_run names the config fields first; this is the last word
            raise UserError(f"parallel_config: {e}") from None

    # ---- shape --------------------------------------------------------------------------------------------
    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """Sizes of MESH_DIMS, the dense mesh every parameter outside routed experts lives on."""
        return tuple(getattr(self, n) for n in MESH_DIMS)

    @property
    def efsdp(self) -> int:
        """FSDP degree of routed experts: what ep (and etp) leave of the dp_shard x cp x tp ranks."""
        return self.dp_shard * self.cp * self.tp // (self.ep * self.etp)

    @property
    def expert_mesh_shape(self) -> tuple[int, ...]:
        """Sizes of EXPERT_MESH_DIMS: the same ranks as the dense mesh, seen by routed experts."""
        return tuple(getattr(self, n) for n in EXPERT_MESH_DIMS)

    @property
    def ep_borrows(self) -> tuple[int, tuple[str, ...]]:
        """How many dense ranks (and which dims) the ep x efsdp ranks of one replica are drawn from, etp aside."""
        names = ("dp_shard", "cp") if self.etp == self.tp and self.tp > 1 else ("dp_shard", "cp", "tp")
        return math.prod(getattr(self, n) for n in names), names

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
        return {n: getattr(self, n) > 1 for n in (*MESH_DIMS, "ep", "etp")}

    @property
    def sharded(self) -> bool:
        """Parameters, gradients and optimizer states sharded over the fsdp mesh (dp_shard x cp; FSDP / HSDP).

        Context parallel ranks shard too: they all need the whole weights, as data-parallel ranks do."""
        return self.mesh_size("fsdp") > 1

    def describe(self) -> str:
        parts = [f"{n}{getattr(self, n)}" for n in (*MESH_DIMS, "ep", "etp") if getattr(self, n) > 1]
        return "x".join(parts) or "single process"

    # ---- named meshes -------------------------------------------------------------------------------------
    def _view(self, name: str) -> tuple[tuple[str, ...], tuple[int, ...], tuple[str, ...]]:
        """(dims of the shape `name` lives in, their sizes, the dims its groups span)."""
        if name not in NAMED_MESHES:
            raise ValueError(f"unknown mesh {name!r}: one of {', '.join(NAMED_MESHES)}")
        shape, spans = NAMED_MESHES[name]
        if shape == "dense":
            return MESH_DIMS, self.mesh_shape, spans
        return EXPERT_MESH_DIMS, self.expert_mesh_shape, spans

    def _coords_in(self, rank: int, names: tuple[str, ...], sizes: tuple[int, ...]) -> dict[str, int]:
        """Coordinate of `rank` in every dim of one shape: row-major, as init_device_mesh lays ranks out."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world size {self.world_size}")
        out, rest = {}, rank
        for name, size in reversed(list(zip(names, sizes))):
            rest, out[name] = divmod(rest, size)
        return {n: out[n] for n in names}

    def mesh_size(self, name: str) -> int:
        """Ranks in each group of the named mesh."""
        names, sizes, spans = self._view(name)
        return math.prod(s for n, s in zip(names, sizes) if n in spans)

    def coord(self, rank: int, name: str) -> int:
        """`rank`'s index inside its group of the named mesh (row-major over the dims the mesh spans)."""
        names, sizes, spans = self._view(name)
        c = self._coords_in(rank, names, sizes)
        index = 0
        for n, size in zip(names, sizes):
            if n in spans:
                index = index * size + c[n]
        return index

    def mesh_groups(self, name: str) -> list[list[int]]:
        """The rank groups of a named mesh: ranks that differ only in the dims it spans, each group ordered by
        coordinate, the groups by their first rank. Every rank is in exactly one group."""
        names, sizes, spans = self._view(name)
        found: dict[tuple, list[int]] = {}
        for r in range(self.world_size):
            c = self._coords_in(r, names, sizes)
            found.setdefault(tuple(c[n] for n in names if n not in spans), []).append(r)
        return list(found.values())

    def groups(self, dim: str) -> list[list[int]]:
        """The rank groups of one dim or named mesh ("pp", "tp", "dp", "loss", ...): `mesh_groups`."""
        return self.mesh_groups(dim)

    # ---- ranks --------------------------------------------------------------------------------------------
    def coords(self, rank: int) -> dict[str, int]:
        """Coordinate of `rank` in every dense mesh dim (row-major over MESH_DIMS, as init_device_mesh lays ranks
        out), plus the flattened data-parallel index "dp" (its place in the batch mesh)."""
        out = self._coords_in(rank, MESH_DIMS, self.mesh_shape)
        out["dp"] = out["dp_replicate"] * self.dp_shard + out["dp_shard"]
        return out

    def is_metrics_rank(self, rank: int) -> bool:
        """The rank that logs and writes metrics: last pipeline stage, first loss-mesh and tensor rank."""
        c = self.coords(rank)
        return c["pp"] == self.last_stage_pp_rank and self.coord(rank, "loss") == 0 and c["tp"] == 0
