"""A run's plan before it runs: memory per pipeline stage (with what estimators usually miss) and throughput.

On top of planner/memory.py's model states and saved activations, a rank's peak holds:
  logits        the last stage's logits (T x vocab / t in the compute dtype) and, below fp32, their fp32 copy for
                the loss, alive together with the saved activations at the end of the forward pass
  optimizer     foreach AdamW's temporaries at the step, about one more copy of what it updates (the gradients);
                none for fused AdamW (the default)
  recompute     one recomputed layer's activations, made again during its backward (after the logits are freed)
  FSDP          the gathered weights of two layers (the one computing and the one prefetched), compute dtype; of an
                MoE layer under expert parallelism only the rank's experts; FP8 linears gathered in FP8
                (fp8_config.enable_fsdp_float8_all_gather) at one byte (planner/fp8.py)
  all-to-all    expert parallelism's send and receive buffers of one layer (planner/experts.py), in forward beside
                the logits' time or in backward beside a recomputed layer
  runtime       what the framework takes before any tensor (CUDA context, one communicator per parallel
                dimension, cuBLAS/attention workspaces), per accelerator (planner/accelerators.py)
  reserved      the caching allocator's reserve: the resident states (weights, AdamW moments, a frozen second
                model's weights, allocated once before the first step and never freed) as allocated, and what each
                step allocates and frees (activations, logits, gradients, gathers) with the fragmentation the
                allocator leaves between those blocks; the runtime comes on top of it (torch reports reserved memory
                without it, torchtitan too), and reserved + runtime is compared with the device's memory
  second model  post-training's frozen reference or teacher (planner/second_model.py): its weights resident, a
                teacher's logits beside the student's; a preference pair is two rows of the micro-batch
Gradients are freed after every step (zero_grad(set_to_none)), so a step of one micro-batch peaks before any
exists; accumulation and pipeline schedules run later micro-batches' forwards with them. Peak allocated =
parameters + optimizer states + max(activations + FSDP + max(logits, recompute) [+ gradients when accumulating or
pipelining], gradients + optimizer temporaries); reserved = resident + (allocated - resident) x (1 + fragmentation),
fragmentation 0.2 eager and 0.125 compiled (fewer, fused allocations); reserved + runtime is compared with the
device's memory. With `cpu_offload` the states and the optimizer
step are host memory (`host_bytes`) and the device holds the rest; so are swapped layers' activations
(`swap_config`), of which the device holds the layer in backward and those prefetched (in `recompute_bytes`).
A CPU run has no host memory apart from its own, so there swap is off.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from meshformer.config.schema import MeshformerConfig
from meshformer.models.registry import family_of
from meshformer.parallel.batch_plan import BatchPlan
from meshformer.parallel.dims import ParallelDims
from meshformer.planner.accelerators import Accelerator
from meshformer.planner.context_parallel import local_config, with_context_parallel
from meshformer.planner.experts import ExpertFigures, expert_figures
from meshformer.planner.fp8 import fp8_gathered_saving
from meshformer.planner.memory import StageMemory, plan_memory
from meshformer.planner.second_model import SecondModel, rows_per_sample, second_model
from meshformer.planner.throughput import Throughput, planned_compiled, predict

# Reserved over allocated of what a step allocates and frees, measured by the CUDA allocator on one H200 with
# expandable segments (docs/memory.md): 0.15-0.23 eager (median 0.21; 0.50 with full recompute on the 1B shape),
# 0.12-0.13 compiled (paired with the eager rows of the same runs).
FRAGMENTATION = {False: 0.2, True: 0.125}


@dataclass
class StagePlan:
    memory: StageMemory
    logits_bytes: int
    optimizer_step_bytes: int
    fsdp_gathered_bytes: int
    allocated_bytes: int
    reserved_bytes: int
    headroom_bytes: int
    host_bytes: int = 0  # states (and the optimizer step) kept in host memory by cpu_offload
    second: SecondModel = dataclasses.field(default_factory=lambda: SecondModel(""))  # reference or teacher
    resident_bytes: int = 0  # allocated once before the first step (weights, moments): no fragmentation

    def as_dict(self) -> dict:
        return {
            **self.memory.as_dict(),
            "second_model": self.second.as_dict(),
            "logits_bytes": self.logits_bytes,
            "optimizer_step_bytes": self.optimizer_step_bytes,
            "fsdp_gathered_bytes": self.fsdp_gathered_bytes,
            "allocated_bytes": self.allocated_bytes,
            "reserved_bytes": self.reserved_bytes,
            "headroom_bytes": self.headroom_bytes,
            "host_bytes": self.host_bytes,
        }


@dataclass
class Plan:
    cfg: MeshformerConfig
    dims: ParallelDims
    accelerator: Accelerator
    device_memory: float
    nodes: int
    micro_batch: int
    n_micro: int
    stages: list[StagePlan]
    throughput: Throughput
    moe: ExpertFigures | None = None  # parameters and all-to-all of an MoE model (planner/experts.py)

    @property
    def fits(self) -> bool:
        return all(s.headroom_bytes >= 0 for s in self.stages)

    def as_dict(self) -> dict:
        t = self.throughput
        return {
            "layout": {
                "data_parallel": self.dims.dp,
                "model_parallel": self.dims.tp,
                "pipeline_stage": self.dims.pp,
                "optimizer_shard": self.dims.dp_shard,
                "expert_parallel": self.dims.ep,
                "expert_fsdp": self.dims.efsdp if self.dims.ep > 1 else self.dims.dp_shard,
                "devices": self.dims.world_size,
                "nodes": self.nodes,
                "micro_batch": self.micro_batch,
                "micro_batches_per_step": self.n_micro,
                "global_batch": self.micro_batch * self.n_micro * self.dims.dp,
            },
            "accelerator": self.accelerator.name,
            "device_memory_bytes": self.device_memory,
            "stages": [s.as_dict() for s in self.stages],
            "flops_per_token": t.flops_per_token,
            "flops_per_step": t.flops_per_step,
            "hardware_flops_per_step": t.hardware_flops_per_step,
            "communication_bytes_per_step": {
                "tp": t.tp_bytes,
                "dp": t.dp_bytes,
                "pp": t.pp_bytes,
                "ep": t.ep_bytes,
                "cp": t.cp_bytes,
            },
            "moe": self.moe.as_dict() if self.moe is not None else None,
            "bubble_fraction": t.bubble_fraction,
            "step_time_s": t.step_time_s,
            "tokens_per_s": t.tokens_per_s,
            "samples_per_s": t.samples_per_s,
            "mfu": t.mfu,
            "compiled": t.compiled,
            "fits": self.fits,
        }


def make_plan(
    cfg: MeshformerConfig,
    dims: ParallelDims,
    acc: Accelerator,
    micro_batch: int,
    n_micro: int,
    nodes: int = 1,
    device_memory: float | None = None,
) -> Plan:
    if acc.name == "cpu" and cfg.swap_config.swap:
        cfg = dataclasses.replace(cfg, swap_config=dataclasses.replace(cfg.swap_config, swap=False))
    mc = cfg.model.model_config
    mem = device_memory or acc.memory_bytes
    fused = cfg.optimizer.fused if cfg.optimizer.fused is not None else True  # train/optim.use_fused
    low = mc.compute_dtype != "float32"
    a = 2 if low else 4
    rows = micro_batch * rows_per_sample(cfg)  # a preference pair is two rows of the micro-batch
    T = rows * mc.seq_length // dims.cp  # a context-parallel rank's tokens of its rows
    stages = []
    moe = expert_figures(cfg, dims, rows, n_micro)
    layer_params = _layer_param_count(mc)
    if moe is not None and dims.ep > 1:  # an MoE layer gathers only this rank's experts (efsdp), whole across tp
        routed = moe.routed_params // moe.moe_layers
        layer_params = (layer_params - routed) + routed * dims.tp // dims.ep
    a2a = moe.a2a_buffer_bytes if moe is not None else 0
    compiled = planned_compiled(cfg, dims, acc)
    for st in plan_memory(local_config(cfg), dims, rows, n_micro):
        st = with_context_parallel(st, cfg, dims, rows)  # the gathered keys and values
        last = st.stage == dims.pp - 1 or (dims.pp > 1 and cfg.parallel_config.pipeline_schedule in _V)
        logits = (T * math.ceil(mc.vocab_size / dims.tp) * (a + (4 if low else 0))) if last else 0
        v_shape = dims.pp > 1 and cfg.parallel_config.pipeline_schedule in _V  # rank 0 holds the last stage
        second = second_model(cfg, dims, st.stage, T, st.stage == (0 if v_shape else dims.pp - 1), n_micro)
        logits += second.beside_bytes  # the teacher's logits and forward, alive with the student's
        offload = cfg.parallel_config.cpu_offload and acc.name != "cpu"
        step_tmp = 0 if fused else st.grads_bytes  # foreach: one more copy of what it updates
        gathered = (2 * layer_params // dims.tp * a - 2 * fp8_gathered_saving(cfg, a) // dims.tp) * (dims.dp_shard > 1)
        working = st.activations_bytes + gathered + max(logits + st.autocast_cache_bytes, st.recompute_bytes + a2a)
        # cpu_offload: the shards, gradients and optimizer states (and the step) live in host memory
        host = (st.states_bytes + step_tmp if offload else 0) + st.swapped_bytes
        early = st.grads_bytes if n_micro > 1 or dims.pp > 1 else 0  # gradients alive at the activation peak
        resident = st.params_bytes + st.optimizer_bytes + second.weights_bytes  # a frozen second model's weights
        # the reference's forward runs before the policy's: its transient never meets the policy's activations
        peaks = (working + early, st.grads_bytes + step_tmp, second.forward_bytes)
        allocated = max(working, second.forward_bytes) if offload else resident + max(peaks)
        fixed = 0 if offload else resident  # allocated once, before the first step
        reserved = int(fixed + (allocated - fixed) * (1 + FRAGMENTATION[compiled]))
        headroom = int(mem - reserved - acc.runtime(dims))
        stages.append(StagePlan(st, logits, step_tmp, gathered, allocated, reserved, headroom, host, second, fixed))
    swapped = max(st.memory.swapped_bytes for st in stages) * max(1, n_micro) / max(1, stages[0].memory.in_flight)
    batch = BatchPlan(micro_batch, n_micro, micro_batch * n_micro * dims.dp)
    moved = 0 if cfg.parallel_config.cpu_offload else max(_optimizer_bytes_moved(s.memory) for s in stages)
    throughput = predict(cfg, dims, acc, batch, nodes, swapped, moved)
    return Plan(cfg, dims, acc, mem, nodes, micro_batch, n_micro, stages, throughput, moe)


_V = ("zbv_zero_bubble", "dualpipev")  # V schedules: rank 0 also holds the last stage


def _optimizer_bytes_moved(st: StageMemory) -> int:
    """Device memory a rank's AdamW step reads (trained weights, gradients, moments) and writes (weights, moments)."""
    return 3 * st.grads_bytes + 2 * st.optimizer_bytes  # the trained weights: as many bytes as their gradients


def _layer_param_count(mc) -> int:
    """Parameters of one decoder layer, from the family's own count (the model with two layers minus with one), so
    it holds for any registered family."""
    count = family_of(mc).param_count
    return count(dataclasses.replace(mc, num_layers=2)) - count(dataclasses.replace(mc, num_layers=1))
