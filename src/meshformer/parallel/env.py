"""The process layout: turns `parallel_config` into a DeviceMesh. The only module that does rank arithmetic.

Mesh dims, outermost first: ("pp", "dp_replicate", "dp_shard", "tp"). Tensor parallel is innermost so its
ranks are neighbours (same node, fastest links: it communicates every layer); pipeline is outermost (it only
sends activations between stages, so it tolerates slow links between nodes). Data parallel sits between and
is split in two for optimizer sharding: `dp_shard` ranks shard parameters/gradients/optimizer states (FSDP)
and `dp_replicate` ranks hold copies (HSDP); without sharding dp_shard is 1. The flattened `dp` dim
(dp_replicate x dp_shard) is the data-parallel group that sums token counts and losses. Context and expert
parallel are reserved (the schema only accepts 1), they would join as further named dims.

Single-process runs (no torchrun) get a ParallelEnv with every degree 1 and no process group.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from meshformer.config.schema import MeshformerConfig
from meshformer.config.validate import V_SCHEDULES, validate_run
from meshformer.errors import UserError

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


@dataclass
class ParallelEnv:
    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    dp_size: int = 1
    dp_rank: int = 0
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    last_stage_pp_rank: int = 0  # pp rank holding the last pipeline stage (0 under V schedules)
    dp_shard_size: int = 1      # FSDP shard group size (1: no optimizer sharding)
    dp_replicate_size: int = 1  # HSDP / DDP replicas (dp_size // dp_shard_size)
    backend: str = ""
    mesh: object | None = None  # torch.distributed DeviceMesh, dims MESH_DIMS plus the flattened "dp"
    coords: dict = field(default_factory=dict)
    dp_mesh: object | None = None  # the flattened (dp_replicate x dp_shard) mesh, kept here rather than re-sliced

    @property
    def distributed(self) -> bool:
        return self.mesh is not None

    @property
    def is_metrics_rank(self) -> bool:
        """The rank that logs and writes metrics: last pipeline stage, first data-parallel and tensor rank."""
        return self.pp_rank == self.last_stage_pp_rank and self.dp_rank == 0 and self.tp_rank == 0

    @property
    def grad_average_size(self) -> int:
        """How many ranks gradient reduction averages over (the loss is pre-multiplied by it)."""
        return self.dp_size

    @property
    def sharded(self) -> bool:
        return self.dp_shard_size > 1

    def submesh(self, *names: str):
        return self.mesh[names[0]] if len(names) == 1 else self.mesh[names]

    def group(self, name: str):
        """The process group of one mesh dim ("pp", "dp", "tp", ...) for this rank."""
        return self.dp_mesh.get_group() if name == "dp" else self.mesh[name].get_group()

    def all_reduce_sum_dp(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the data-parallel group (in place, also returned). A no-op without data parallelism."""
        if self.distributed and self.dp_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group("dp"))
        return t

    def all_reduce_sum_pp(self, t: torch.Tensor) -> torch.Tensor:
        if self.distributed and self.pp_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group("pp"))
        return t

    def barrier(self) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.barrier()

    def shutdown(self) -> None:
        # A barrier right before destroy_process_group: without it a rank sometimes aborts at exit on gloo
        # ("terminate called without an active exception"), see shared/reference/environment-notes.md.
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    def describe(self) -> str:
        c = " ".join(f"{k}={v}" for k, v in self.coords.items())
        return f"rank {self.rank}/{self.world_size} backend={self.backend or 'none'} device={self.device} {c}".rstrip()


def _device() -> torch.device:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def init_parallel(cfg: MeshformerConfig, world_size: int | None = None) -> ParallelEnv:
    """Validate the layout against the launched world, then create (or reuse) the process group and mesh.

    Every check runs before the process group exists, so a bad layout fails in one line on every rank
    instead of hanging in a collective. Calling it again in the same process (tests) reuses the process
    group and builds a new mesh for the new layout.
    """
    world = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    validate_run(cfg, world)
    pc = cfg.parallel_config
    dp, tp, pp = pc.data_parallel, pc.model_parallel, pc.pipeline_stage
    shard = shard_degree(cfg)
    if world == 1:
        return ParallelEnv(device=_device(), dp_shard_size=1)

    device = _device()
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        # The timeout turns a dead or stuck rank into an error on the others instead of a hang.
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=cfg.comm_timeout))
    if dist.get_world_size() != world:
        raise UserError(f"WORLD_SIZE={world} but the process group has {dist.get_world_size()} ranks: "
                        f"launch with torchrun --nproc-per-node {world}")
    from torch.distributed.device_mesh import init_device_mesh

    shape = (pp, dp // shard, shard, tp)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=MESH_DIMS)
    dp_mesh = mesh["dp_replicate", "dp_shard"]._flatten("dp")
    coord = dict(zip(MESH_DIMS, mesh.get_coordinate()))
    dp_rank = coord["dp_replicate"] * shard + coord["dp_shard"]
    env = ParallelEnv(world_size=world, rank=dist.get_rank(), local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                      device=device, dp_size=dp, dp_rank=dp_rank, tp_size=tp, tp_rank=coord["tp"],
                      pp_size=pp, pp_rank=coord["pp"], last_stage_pp_rank=0 if pc.pipeline_schedule in V_SCHEDULES else pp - 1,
                      dp_shard_size=shard, dp_replicate_size=dp // shard,
                      backend=dist.get_backend(), mesh=mesh, dp_mesh=dp_mesh,
                      coords={"pp": coord["pp"], "dp": dp_rank, "tp": coord["tp"],
                              "dp_replicate": coord["dp_replicate"], "dp_shard": coord["dp_shard"]})
    return env
