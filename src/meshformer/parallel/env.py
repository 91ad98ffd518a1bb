"""The runtime half of the layout: process group, DeviceMeshes and collectives, built from `ParallelDims`.

`dims.py` does all the rank arithmetic (and is tested without processes); this module only starts the
process group, asks torch for the dense mesh of `dims.mesh_shape` over MESH_DIMS ("pp", "dp_replicate",
"dp_shard", "cp", "tp"; a size-1 dim is still a mesh dim), flattens the named meshes that span several dims
("batch", "loss", "fsdp") with `backends.torch_private.flatten_mesh`, and checks that torch placed this rank where
`dims.coords` and `dims.mesh_groups` say. `mesh_for(name)` hands a technique its mesh and `reduce_sum(t, name)`
sums over one (the loss and token counts over "loss"). Under expert parallelism (ep > 1) a second DeviceMesh over
EXPERT_MESH_DIMS ("pp", "dp_replicate", "efsdp", "ep", "etp") lays the same ranks out as routed experts see them;
`mesh_for("ep")`, `mesh_for("efsdp")` and `mesh_for("dp_replicate", "efsdp")` (HSDP of experts) come from it.
Single-process runs (no torchrun) get a ParallelEnv with every degree 1
and no process group.
"""

from __future__ import annotations

import datetime
import os
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from meshformer.backends.torch_private import flatten_mesh
from meshformer.config.schema import MeshformerConfig
from meshformer.errors import UserError
from meshformer.parallel.dims import EXPERT_MESH_DIMS, MESH_DIMS, NAMED_MESHES, ParallelDims
from meshformer.parallel.peers import Peers

FLATTENED = ("batch", "loss", "fsdp")  # the named meshes that span several dense dims, flattened once per mesh


@dataclass
class ParallelEnv:
    dims: ParallelDims = field(default_factory=ParallelDims)
    rank: int = 0
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: str = ""
    mesh: object | None = None  # torch.distributed DeviceMesh over MESH_DIMS
    flat_meshes: dict = field(default_factory=dict)  # "batch", "loss", "fsdp": flattened once, kept (build_meshes)
    expert_mesh: object | None = None  # DeviceMesh over EXPERT_MESH_DIMS, only under expert parallelism
    peers: Peers | None = None  # heartbeats in the launcher's store, to name a dead or hung rank
    coords: dict = field(init=False)

    def __post_init__(self) -> None:
        self.coords = self.dims.coords(self.rank)

    # Degrees and this rank's coordinates, all read from dims (the one place that computes them).
    world_size = property(lambda self: self.dims.world_size)
    dp_size = property(lambda self: self.dims.dp)
    tp_size = property(lambda self: self.dims.tp)
    pp_size = property(lambda self: self.dims.pp)
    dp_shard_size = property(lambda self: self.dims.dp_shard)
    dp_replicate_size = property(lambda self: self.dims.dp_replicate)
    sharded = property(lambda self: self.dims.sharded)
    last_stage_pp_rank = property(lambda self: self.dims.last_stage_pp_rank)
    dp_rank = property(lambda self: self.coords["dp"])
    tp_rank = property(lambda self: self.coords["tp"])
    pp_rank = property(lambda self: self.coords["pp"])

    @property
    def distributed(self) -> bool:
        return self.mesh is not None

    @property
    def is_metrics_rank(self) -> bool:
        """The rank that logs and writes metrics: last pipeline stage, first data-parallel and tensor rank."""
        return self.dims.is_metrics_rank(self.rank)

    @property
    def grad_average_size(self) -> int:
        """How many ranks gradient reduction averages over (the loss is pre-multiplied by it): the loss mesh."""
        return self.dims.mesh_size("loss")

    def mesh_size(self, name: str) -> int:
        return self.dims.mesh_size(name)

    def mesh_for(self, *names: str):
        """This rank's DeviceMesh of a named mesh (dims.NAMED_MESHES), or the multi-dim mesh of several (HSDP:
        "dp_replicate", "fsdp"). Only with a process group (`distributed`)."""
        if not self.distributed:
            raise RuntimeError("one process has no DeviceMesh: check env.distributed first")
        for name in names:
            if name not in NAMED_MESHES:
                raise ValueError(f"unknown mesh {name!r}: one of {', '.join(NAMED_MESHES)}")
        if any(NAMED_MESHES[n][0] == "expert" for n in names):
            if self.expert_mesh is None:
                raise RuntimeError(
                    f"the {names} mesh exists under expert parallelism only (parallel_config.expert_parallel > 1)"
                )
            return self.expert_mesh[names[0]] if len(names) == 1 else self.expert_mesh[names]
        if len(names) == 1:
            name = "batch" if names[0] == "dp" else names[0]
            return self.flat_meshes[name] if name in self.flat_meshes else self.mesh[name]
        dense = tuple(self._carrying_dim(n) for n in names)
        if None not in dense:
            return self.mesh[dense]
        with warnings.catch_warnings():  # torch 2.13 still slices flattened dims from the root, with a warning
            warnings.filterwarnings("ignore", message="Slicing a flattened dim")
            return self.mesh[names]

    def submesh(self, *names: str):
        """The dense mesh's sub-mesh of MESH_DIMS names (one, or several as a multi-dim mesh)."""
        return self.mesh[names[0]] if len(names) == 1 else self.mesh[names]

    def _carrying_dim(self, name: str) -> str | None:
        """The one dense dim whose groups are the named mesh's (the other dims it spans have size 1), or None."""
        spans = NAMED_MESHES[name][1]
        wide = [n for n in spans if getattr(self.dims, n) > 1]
        return spans[0] if not wide else wide[0] if len(wide) == 1 else None

    def group(self, name: str):
        """This rank's process group of one named mesh ("pp", "tp", "loss", "fsdp", "dp" = "batch", ...)."""
        return self.mesh_for(name).get_group()

    def reduce_sum(self, t: torch.Tensor, name: str) -> torch.Tensor:
        """Sum `t` over this rank's group of the named mesh (in place, also returned); a no-op for one process or
        a mesh of size 1."""
        if self.distributed and self.dims.mesh_size(name) > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group(name))
        return t

    def all_reduce_sum_dp(self, t: torch.Tensor) -> torch.Tensor:
        """Deprecated: `reduce_sum(t, "batch")` (tests/dist/dead_rank.py still calls it)."""
        return self.reduce_sum(t, "batch")

    def all_reduce_sum_pp(self, t: torch.Tensor) -> torch.Tensor:
        return self.reduce_sum(t, "pp")

    def all_ok(self, ok: bool) -> bool:
        """True only when every rank passes True (a collective: every rank must call it).

        The flag is a CPU tensor, reduced over gloo (the process group pairs gloo with NCCL on GPUs): reading it
        back never waits for the GPU's queue, so calling this every step adds no device sync."""
        if not self.distributed:
            return ok
        flag = torch.tensor([0.0 if ok else 1.0])
        dist.all_reduce(flag, op=dist.ReduceOp.SUM)
        return float(flag) == 0.0

    def broadcast_object(self, obj):
        """Rank 0's `obj` on every rank (small, picklable values this process made: decisions, paths)."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather_object(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank (small, picklable values this process made)."""
        if not self.distributed:
            return [obj]
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    def side_groups(self, n: int) -> list:
        """`n` new gloo groups of every rank for the collectives of background threads (async checkpoint writes):
        one group's collectives must all come from one thread. Collective: every rank calls it at the same point.
        One process first gets a process group of its own (world size 1), so DCP takes its usual path."""
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        return [dist.new_group(backend="gloo") for _ in range(n)]

    def barrier(self) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.barrier()

    def at_step(self, step: int) -> None:
        """Record the step this rank has completed (reported if a peer fails)."""
        if self.peers is not None:
            self.peers.step = step

    def explain_failure(self, error: BaseException) -> str | None:
        """One line naming the dead or hung rank(s) behind `error`, or None (one process, or no culprit)."""
        return self.peers.explain(error) if self.peers is not None else None

    def shutdown(self, clean: bool = True) -> None:
        # A barrier right before destroy_process_group: without it a rank sometimes aborts at exit on gloo
        # ("terminate called without an active exception"), see shared/reference/environment-notes.md.
        # After a failure there is no barrier: a dead or hung peer would hold it until comm_timeout.
        if self.peers is not None:
            self.peers.close()
        if dist.is_available() and dist.is_initialized():
            if clean:
                dist.barrier()
            dist.destroy_process_group()

    def describe(self) -> str:
        order = ("pp", "dp", "tp", *(n for n in MESH_DIMS if n not in ("pp", "tp")))  # the user's dims first
        c = " ".join(f"{k}={self.coords[k]}" for k in order)
        return f"rank {self.rank}/{self.world_size} backend={self.backend or 'none'} device={self.device} {c}".rstrip()


def local_device() -> torch.device:
    """This process's device: the GPU of its LOCAL_RANK when there are GPUs, else the CPU."""
    if torch.cuda.is_available():
        # Expandable segments (as torchtitan sets): blocks grow in place instead of new fixed-size segments, so
        # the caching allocator reserves little beyond what it hands out. Read when CUDA first allocates; a
        # user's own setting wins.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if local >= torch.cuda.device_count():
            raise UserError(
                f"LOCAL_RANK={local} but this node sees {torch.cuda.device_count()} GPU(s): start at most that "
                f"many processes per node (--nproc-per-node), or fix CUDA_VISIBLE_DEVICES"
            )
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    """NCCL for GPU tensors with gloo beside it for CPU ones (object collectives, CPU-side checks); gloo on CPU."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def start_process_group(device: torch.device, timeout_s: float) -> None:
    """init_process_group once per process (tests run several layouts on one group).

    The timeout turns a dead or stuck rank into an error on the others instead of a hang. Under torchrun each
    restart attempt gets its own key prefix in the rendezvous store: the store outlives an attempt, and a
    restarted rank could otherwise read a dead rank's gloo address from the attempt before and fail with
    "connectFullMesh ... Connection refused" (docs/checkpoints.md).
    """
    if dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        dist.init_process_group(backend=backend_for(device), timeout=timeout)
        return
    from torch.distributed.rendezvous import rendezvous

    store, rank, world = next(rendezvous("env://", timeout=timeout))
    store = dist.PrefixStore(f"meshformer/attempt_{attempt}/", store)
    dist.init_process_group(backend=backend_for(device), store=store, rank=rank, world_size=world, timeout=timeout)


def init_parallel(cfg: MeshformerConfig, world_size: int | None = None) -> ParallelEnv:
    """Validate the layout against the launched world, then create (or reuse) the process group and mesh.

    Every check runs before the process group exists, so a bad layout fails in one line on every rank
    instead of hanging in a collective. Calling it again in the same process (tests) reuses the process
    group and builds a new mesh for the new layout.
    """
    world = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    dims = ParallelDims.from_config(cfg, world)
    device = local_device()
    if world == 1:
        return ParallelEnv(dims=dims, device=device)
    start_process_group(device, cfg.comm_timeout)
    if dist.get_world_size() != world:
        raise UserError(
            f"WORLD_SIZE={world} but the process group has {dist.get_world_size()} ranks: "
            f"launch with torchrun --nproc-per-node {world}"
        )
    mesh, flat = build_meshes(dims, device.type)
    env = ParallelEnv(
        expert_mesh=build_expert_mesh(dims, device.type),
        dims=dims,
        rank=dist.get_rank(),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        device=device,
        backend=dist.get_backend(),
        mesh=mesh,
        flat_meshes=flat,
        peers=Peers.connect(dist.get_rank(), world),
    )
    check_placement(env)
    return env


def build_meshes(dims: ParallelDims, device_type: str) -> tuple[object, dict]:
    """The dense DeviceMesh over MESH_DIMS and the named meshes flattened from it ("batch", "loss", "fsdp"), on the
    process group that exists (a run's, or the planner's fake one). Collective: every rank calls it."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, dims.mesh_shape, mesh_dim_names=MESH_DIMS)
    flat = {name: flatten_mesh(mesh, NAMED_MESHES[name][1], name) for name in FLATTENED}
    return mesh, flat


def build_expert_mesh(dims: ParallelDims, device_type: str):
    """The DeviceMesh over EXPERT_MESH_DIMS (the same ranks, as routed experts see them), or None without expert
    parallelism. Collective: every rank calls it."""
    if dims.ep == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, dims.expert_mesh_shape, mesh_dim_names=EXPERT_MESH_DIMS)


def check_placement(env: ParallelEnv) -> None:
    """Fail unless torch put this rank where dims says: its dense coordinates and its group of each named mesh."""
    placed = dict(zip(MESH_DIMS, env.mesh.get_coordinate()))
    if placed != {n: env.coords[n] for n in MESH_DIMS}:
        raise RuntimeError(f"rank {env.rank}: DeviceMesh put it at {placed}, ParallelDims computed {env.coords}")
    named = dict(env.flat_meshes)
    if env.expert_mesh is not None:
        named.update({n: env.expert_mesh[n] for n in ("efsdp", "ep", "etp")})
    for name, sub in named.items():
        group = next(g for g in env.dims.mesh_groups(name) if env.rank in g)
        if sub.mesh.flatten().tolist() != group:
            raise RuntimeError(f"rank {env.rank}: the {name!r} mesh is {sub.mesh.tolist()}, ParallelDims has {group}")
