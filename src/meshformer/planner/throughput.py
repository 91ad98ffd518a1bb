"""FLOPs, communication and predicted step time of a layout (estimates, with their formulas).

FLOP convention (the trainer's MFU uses the same rule, the model family's flops_per_token, models/registry.py): model
FLOPs per token = 6 x the parameters that do a matmul per token (all but the input embedding, plus the output
projection, tied or not; of an MoE model only the active ones, top-k routed experts) + 12 x layers x heads x
head_dim x seq_length (the family's `attention_cost`: latent attention's q/k and v heads have widths of their own;
PaLM / torchtitan: the causal attention term is not halved). Recompute adds one forward (2/6 of the layer FLOPs) to
the hardware's work but not to the model's, so it lowers throughput, not MFU's numerator; so do the matmuls
selective recompute's `alternate_matmuls` policy runs again (planner/extra_work.py) and the global-batch balancing
loss's routing pre-pass (one forward of the whole model per step).

Communication per rank and step (ring collectives move 2(n-1)/n of the buffer for an all-reduce, (n-1)/n for an
all-gather or reduce-scatter):
  tensor parallel  4 all-reduces of T x h per layer and micro-batch (2 forward, 2 backward; +2 with full
                   recompute); sequence parallel turns each into an all-gather + reduce-scatter of the same volume
  data parallel    one all-reduce of the gradients (fp32); FSDP: all-gather of the weights in forward (and again
                   in backward with ZeRO-3) + reduce-scatter of the gradients
  pipeline         T x h (/ t) activations forward and their gradients backward per stage boundary and micro-batch
  expert parallel  all-to-all of the routed rows, dispatch + combine forward and backward (planner/experts.py);
                   routed experts' gradients reduce over dp_replicate x efsdp, the rest over data parallel
  context parallel per attention layer and micro-batch, the all-gather of K and V over cp (micro_batch x seq x
                   the family's cp_gather_width: 2 x kv_heads / tp x head_dim, latent attention its latent and
                   rotary key; (cp-1)/cp of it received) forward, its reduce-scatter backward, one
                   more all-gather with full recompute (parallel/context_parallel.py); tp and pp move a cp rank's
                   seq / cp tokens
Activation swap: the swapped bytes go to host memory during forward (overlapping its third of the compute) and
come back during backward (its two thirds), at the accelerator's host link bandwidth.
Step time = compute / (1 - bubble) + tensor-parallel, pipeline, all-to-all and K/V-gather transfers (on the critical
path) + swap
+ the part of the data-parallel transfers that does not hide behind the backward pass (assumed: all but 20% of compute).
FP8 linears (fp8_config, on a device with FP8 units): their matmuls at the FP8 peak, casts paid (planner/fp8.py).
QLoRA's NF4 base: its dequantization in every forward and backward, at HBM bandwidth (planner/nf4.py).
Bubble = (p - 1) / (m + p - 1) for GPipe and 1F1B, divided by v for interleaved schedules with v stages per rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshformer.config.schema import MeshformerConfig
from meshformer.models.registry import family_of
from meshformer.parallel.batch_plan import BatchPlan
from meshformer.parallel.dims import ParallelDims
from meshformer.planner.accelerators import Accelerator
from meshformer.planner.experts import expert_figures
from meshformer.planner.extra_work import prepass_share, recompute_share, selective_recompute_flops_per_token
from meshformer.planner.fp8 import fp8_figures
from meshformer.planner.nf4 import nf4_dequant_s


@dataclass
class Throughput:
    flops_per_token: float  # model FLOPs (the MFU convention)
    flops_per_step: float  # model FLOPs of one optimizer step, all ranks
    hardware_flops_per_step: float  # with recompute's extra forward
    compute_s: float  # per rank, bubble excluded
    bubble_fraction: float
    tp_bytes: float  # per rank and step
    dp_bytes: float
    pp_bytes: float
    tp_s: float
    dp_s: float
    pp_s: float
    step_time_s: float
    tokens_per_s: float
    samples_per_s: float
    mfu: float
    swap_bytes: float = 0.0  # per rank and step, each way
    swap_s: float = 0.0  # the part of the swap copies that does not hide behind compute
    ep_bytes: float = 0.0  # expert parallelism's all-to-all, per rank and step, sent (planner/experts.py)
    ep_s: float = 0.0  # its time (on the critical path)
    cp_bytes: float = 0.0  # context parallelism's K/V all-gathers and their reduce-scatters, per rank and step
    cp_s: float = 0.0  # their time (on the critical path: attention waits for the gathered keys)
    fp8_share: float = 0.0  # fp8_config: share of the model FLOPs that run in FP8 (planner/fp8.py)
    fp8_saved_s: float = 0.0  # ... and the compute time per rank and step that FP8 saves, casts paid
    compiled: bool = False  # planned with compiled layers (`compile`, planned_compiled)
    efficiency: float = 0.0  # share of peak the step's hardware FLOPs reach (Accelerator.step_efficiency)
    nf4_dequant_s: float = 0.0  # QLoRA: per rank and step, dequantizing the NF4 base weights (planner/nf4.py)


def flops_per_token(cfg: MeshformerConfig) -> float:
    """The model family's one FLOPs rule (models/registry.py: ModelFamily.flops_per_token)."""
    mc = cfg.model.model_config
    return family_of(mc).flops_per_token(mc)


def bubble_fraction(cfg: MeshformerConfig, n_micro: int) -> float:
    pc = cfg.parallel_config
    p = pc.pipeline_stage
    if p == 1:
        return 0.0
    v = pc.pp_interleave_num if pc.pipeline_schedule not in ("gpipe", "1f1b") else 1
    return (p - 1) / (v * n_micro + p - 1)


def planned_compiled(cfg: MeshformerConfig, dims: ParallelDims, acc: Accelerator) -> bool:
    """Whether the run compiles its layers: `compile` true or false as written; auto as the trainer decides it
    (parallel/parallelize.py `compile_decision`) on a GPU, where it compiles unless tensor, context or expert
    parallelism or activation swap is on. A CPU's auto depends on the run's length and a C++ compiler, and the
    planner's CPU efficiency is one figure: planned eager there; other accelerators: eager."""
    if cfg.compile != "auto":
        return bool(cfg.compile)
    gpu = acc.name in _GPUS or acc.name.startswith(_GPUS)
    return gpu and dims.tp == 1 and dims.cp == 1 and dims.ep == 1 and not cfg.swap_config.swap


_GPUS = ("H100", "H200", "A100")


def step_efficiency(cfg: MeshformerConfig, acc: Accelerator, peak: float, compiled: bool) -> float:
    """The accelerator's share of `peak` for this model's step (Accelerator.step_efficiency)."""
    mc = cfg.model.model_config
    recomputed = bool(recompute_share(cfg)) or bool(cfg.recompute_config.select_recompute)
    item = 2 if mc.compute_dtype != "float32" else 4
    return acc.step_efficiency(peak, compiled, recomputed, mc.hidden_size, item)


def hardware_flops(cfg: MeshformerConfig, fpt: float, tokens: int) -> float:
    """The FLOPs a step runs: the model's, plus what full recompute repeats of the layers (not the output head),
    the pre-pass and the matmuls a selective policy recomputes."""
    mc = cfg.model.model_config
    layer_share = 1 - 6 * mc.vocab_size * mc.hidden_size * (0 if mc.tie_word_embeddings else 1) / max(fpt, 1)
    hardware = fpt * tokens * (1 + recompute_share(cfg) * layer_share / 3 + prepass_share(cfg))
    return hardware + selective_recompute_flops_per_token(cfg) * tokens


def predict(
    cfg: MeshformerConfig,
    dims: ParallelDims,
    acc: Accelerator,
    batch: BatchPlan,
    nodes: int,
    swapped_bytes: float,
    optimizer_bytes_moved: float = 0.0,
) -> Throughput:
    """`swapped_bytes`: activation bytes a rank sends to host memory (and back) per step (swap_config);
    `optimizer_bytes_moved`: what a rank's optimizer step reads and writes in device memory (fused AdamW: the
    weights, gradients and moments read, the weights and moments written), timed at the HBM bandwidth."""
    mc = cfg.model.model_config
    low = mc.compute_dtype != "float32"
    peak = acc.peak_bf16 if low else acc.peak_fp32
    a = 2 if low else 4
    micro_batch, n_micro, global_batch = batch.micro_batch, batch.n_micro, batch.global_batch
    tokens = global_batch * mc.seq_length
    fpt = flops_per_token(cfg)
    model_flops = fpt * tokens
    hardware = hardware_flops(cfg, fpt, tokens)
    world = dims.world_size
    compiled = planned_compiled(cfg, dims, acc)
    efficiency = step_efficiency(cfg, acc, peak, compiled)
    compute = hardware / world / (peak * efficiency) + (optimizer_bytes_moved / acc.hbm_bw if acc.hbm_bw else 0.0)
    fp8 = fp8_figures(cfg, dims, acc, tokens, n_micro, fpt) if low else None
    if fp8 is not None:
        compute -= fp8.saved_s
    dequant_s = nf4_dequant_s(cfg, dims, acc, n_micro)
    compute += dequant_s
    bubble = bubble_fraction(cfg, n_micro)

    T, h, L = micro_batch * mc.seq_length // dims.cp, mc.hidden_size, mc.num_layers  # a cp rank's tokens
    layers_per_rank = L / dims.pp
    t = dims.tp
    calls = 4 + (2 if recompute_share(cfg) else 0)
    tp_bytes = calls * layers_per_rank * n_micro * 2 * (t - 1) / t * T * h * a if t > 1 else 0.0
    moe = expert_figures(cfg, dims, micro_batch, n_micro)
    dp_bytes = _data_parallel_bytes(cfg, dims, moe.routed_params if moe is not None and dims.ep > 1 else 0, a)
    ep_bytes = moe.a2a_bytes if moe is not None else 0.0
    cp_bytes = _cp_bytes(cfg, dims, micro_batch, n_micro, layers_per_rank, a)
    pp_bytes = 2 * n_micro * T * h * a / (t if cfg.parallel_config.use_seq_parallel else 1) if dims.pp > 1 else 0.0
    per_node = max(1, world // max(1, nodes))
    tp_bw = acc.intra_bw if t <= per_node else acc.inter_bw
    dp_bw = acc.inter_bw if nodes > 1 else acc.intra_bw
    pp_bw = acc.inter_bw if nodes > 1 and dims.pp > 1 else acc.intra_bw
    tp_s, dp_s, pp_s = tp_bytes / tp_bw, dp_bytes / dp_bw, pp_bytes / pp_bw
    ep_s = ep_bytes / (acc.intra_bw if dims.ep * dims.tp <= per_node else acc.inter_bw)
    cp_s = cp_bytes / (acc.intra_bw if dims.cp * dims.tp <= per_node else acc.inter_bw)
    swap_t = swapped_bytes / acc.host_bw
    swap_s = max(0.0, swap_t - compute / 3) + max(0.0, swap_t - 2 * compute / 3)
    step = compute / (1 - bubble) + tp_s + pp_s + ep_s + cp_s + swap_s + max(0.0, dp_s - 0.8 * compute)
    return Throughput(
        fpt,
        model_flops,
        hardware,
        compute,
        bubble,
        tp_bytes,
        dp_bytes,
        pp_bytes,
        tp_s,
        dp_s,
        pp_s,
        step,
        tokens / step,
        global_batch / step,
        model_flops / step / (world * peak),
        swapped_bytes,
        swap_s,
        ep_bytes,
        ep_s,
        cp_bytes,
        cp_s,
        fp8.flops_share if fp8 else 0.0,
        fp8.saved_s if fp8 else 0.0,
        compiled,
        efficiency,
        dequant_s,
    )


def _cp_bytes(
    cfg: MeshformerConfig, dims: ParallelDims, micro_batch: int, n_micro: int, layers: float, a: int
) -> float:
    """Bytes a cp rank receives per step for the gathered keys and values (module docstring)."""
    if dims.cp == 1:
        return 0.0
    mc = cfg.model.model_config
    kv = micro_batch * mc.seq_length * family_of(mc).cp_gather_width(mc, dims.tp) * a
    calls = 2 + (1 if recompute_share(cfg) else 0)
    return calls * layers * n_micro * kv * (dims.cp - 1) / dims.cp


def _data_parallel_bytes(cfg: MeshformerConfig, dims: ParallelDims, routed: int, a: int) -> float:
    """Data-parallel bytes per rank and step: the dense parameters over data parallel, the routed experts (when
    expert parallel) over the ranks that hold the same experts, dp_replicate x efsdp."""
    mc = cfg.model.model_config
    gathers = 3 if cfg.recompute_config.parallel_optimizer_comm_recompute else 2
    dense = (family_of(mc).param_count(mc) - routed) / (dims.tp * dims.pp)
    total = _dp_bytes(dims.dp, dims.dp_shard > 1, dense, gathers, a)
    if routed:
        total += _dp_bytes(dims.dp_replicate * dims.efsdp, dims.dp_shard > 1, routed / (dims.ep * dims.pp), gathers, a)
    return total


def _dp_bytes(d: int, sharded: bool, local_params: float, gathers: int, a: int) -> float:
    """Data-parallel bytes per rank and step for `local_params` parameters reduced over `d` ranks: FSDP's
    all-gathers (compute dtype) and fp32 reduce-scatter, or an fp32 all-reduce."""
    if d <= 1:
        return 0.0
    return (d - 1) / d * local_params * (gathers * a + 4) if sharded else 2 * (d - 1) / d * local_params * 4
