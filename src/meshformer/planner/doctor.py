"""`meshformer doctor`: the planner's figures turned into advice, most urgent first (docs/memory.md).

1. Memory: if a stage does not fit, try the knobs cheapest first (a preference run's reference off the device:
   `adapter` with LoRA, `precomputed`; then micro batch, recompute, a LoRA run's base in NF4 (QLoRA), then the
   parallel degrees, optimizer sharding and CPU offload) on the planner and say what each saves and whether it
   then fits.
   Too many micro-batches in flight (GPipe keeps all of them, so halving micro_batch_num halves them) are
   caught the same way.
2. Pipeline bubble over 10%: the micro_batch_num that brings it under.
3. Tensor parallelism across nodes (its collectives run every layer, so it belongs inside a node).
4. A throughput target beyond the hardware: the FLOP/s it needs against what the devices have.
5. fp32 compute where bf16 would do (half the activation memory, several times the matmul speed); a compute-bound
   bf16 run on a GPU with FP8 units: fp8_config, with the step time the planner predicts for it.
6. Mixture-of-Experts: routed experts' states dominating a rank (a larger `expert_parallel` divides them; also a
   memory knob), and expert parallelism's all-to-all taking a large share of the step (ep spanning nodes).
7. A long sequence under recompute: context parallelism (half the data-parallel ranks) with recompute off, when the
   planner finds that it fits and is faster (cp halves a rank's activations for a K/V all-gather per layer, where
   recompute repeats a forward). Also a memory knob.
Each finding is (severity, text); severity "error" makes the command exit 1.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

from meshformer.planner.plan import Plan, make_plan
from meshformer.planner.second_model import reference_knobs

GIB = 1 << 30


@dataclass
class Finding:
    severity: str  # "error" or "warning"
    text: str


def _variant(plan: Plan, **changes) -> Plan | None:
    """The plan with some config fields changed (dotted names), or None when that layout is invalid."""
    from meshformer.errors import UserError
    from meshformer.parallel.batch_plan import BatchPlan
    from meshformer.parallel.dims import ParallelDims

    cfg = copy.deepcopy(plan.cfg)
    for dotted, value in changes.items():
        *path, leaf = dotted.split(".")
        obj = cfg
        for part in path:
            obj = getattr(obj, part)
        setattr(obj, leaf, value)
    try:
        dims = ParallelDims.from_config(cfg, plan.dims.world_size)
    except UserError:
        return None
    batch = BatchPlan.from_config(cfg, dims)
    try:
        return make_plan(cfg, dims, plan.accelerator, batch.micro_batch, batch.n_micro, plan.nodes, plan.device_memory)
    except UserError:  # a change the model refuses (QLoRA on a layer that is no whole number of NF4 blocks)
        return None


def _worst(plan: Plan) -> int:
    return max(s.reserved_bytes for s in plan.stages) + int(plan.accelerator.runtime(plan.dims))


def _batch_knobs(plan: Plan) -> list[tuple[str, dict]]:
    """What shrinks the activations in flight: a smaller micro-batch, a schedule that keeps fewer of them."""
    pc = plan.cfg.parallel_config
    options = []
    mb = plan.micro_batch
    if mb > 1:
        options.append(
            (
                f"train_dataset.batch_size: {mb // 2} (micro batch halved; raise "
                f"runner_config.gradient_accumulation_steps to keep the global batch)",
                {"train_dataset.batch_size": mb // 2},
            )
        )
    if pc.pipeline_stage > 1 and pc.pipeline_schedule in ("gpipe", "looped_bfs") and pc.micro_batch_num > 1:
        options.append(
            (
                f"parallel_config.pipeline_schedule: 1f1b (GPipe keeps all {pc.micro_batch_num} "
                f"micro-batches in flight)",
                {"parallel_config.pipeline_schedule": "1f1b"},
            )
        )
    if pc.pipeline_stage > 1 and pc.micro_batch_num > 2 * pc.pipeline_stage:
        options.append(
            (
                f"parallel_config.micro_batch_num: {pc.micro_batch_num // 2}",
                {"parallel_config.micro_batch_num": pc.micro_batch_num // 2},
            )
        )
    return options


def _state_knobs(plan: Plan) -> list[tuple[str, dict]]:
    """What keeps less per rank: recompute, a narrower dtype, sharded or offloaded states, a wider split."""
    cfg, pc = plan.cfg, plan.cfg.parallel_config
    options = []
    rc = cfg.recompute_config
    if rc.select_recompute is False and rc.recompute is False:
        options.append(("recompute_config.select_recompute: true", {"recompute_config.select_recompute": True}))
    if rc.recompute is not True:
        options.append(("recompute_config.recompute: true", {"recompute_config.recompute": True}))
    pet = cfg.model.model_config.pet_config
    if pet.pet_type == "lora" and pet.quantize_base == "none" and pc.model_parallel == 1:
        options.append(
            (
                "model.model_config.pet_config.quantize_base: nf4 (QLoRA: the frozen base in 4 bits)",
                {"model.model_config.pet_config.quantize_base": "nf4"},
            )
        )
    if cfg.model.model_config.compute_dtype == "float32":
        options.append(("model.model_config.compute_dtype: bfloat16", {"model.model_config.compute_dtype": "bfloat16"}))
    if pc.data_parallel > 1 and plan.dims.dp_shard == 1:
        options.append(
            (
                "parallel_config.optimizer_shard: true (ZeRO: states sharded over data_parallel)",
                {"parallel_config.optimizer_shard": True},
            )
        )
    if pc.data_parallel > 1 and not pc.cpu_offload:
        options.append(
            (
                "parallel_config.cpu_offload: true with optimizer_shard (states in host memory)",
                {"parallel_config.optimizer_shard": True, "parallel_config.cpu_offload": True},
            )
        )
    if pc.context_parallel == 1 and pc.data_parallel % 2 == 0:
        options.append(
            (
                f"parallel_config.context_parallel: 2 with data_parallel {pc.data_parallel // 2} (each rank holds half "
                f"of every sequence)",
                {"parallel_config.context_parallel": 2, "parallel_config.data_parallel": pc.data_parallel // 2},
            )
        )
    if plan.moe is not None and (choices := _ep_choices(plan)):
        text, change = _ep_change(plan, choices[-1])
        options.append((f"{text} (each rank keeps 1/{choices[-1]} of the routed experts)", change))
    for tp, pp in ((2 * pc.model_parallel, pc.pipeline_stage), (pc.model_parallel, 2 * pc.pipeline_stage)):
        dp = pc.data_parallel // 2
        if dp >= 1 and pc.data_parallel % 2 == 0:
            options.append(
                (
                    f"data_parallel {dp} x model_parallel {tp} x pipeline_stage {pp}",
                    {
                        "parallel_config.data_parallel": dp,
                        "parallel_config.model_parallel": tp,
                        "parallel_config.pipeline_stage": pp,
                    },
                )
            )
    return options


def memory_findings(plan: Plan) -> list[Finding]:
    if plan.fits:
        return []
    worst = max(plan.stages, key=lambda s: s.reserved_bytes)
    m = worst.memory
    head = (
        f"out of memory: pipeline rank {m.stage} needs {(plan.device_memory - worst.headroom_bytes) / GIB:.1f} GiB of "
        f"{plan.device_memory / GIB:.1f} GiB (weights {m.params_bytes / GIB:.1f}, gradients {m.grads_bytes / GIB:.1f}, "
        f"optimizer {m.optimizer_bytes / GIB:.1f}, activations {m.activations_bytes / GIB:.1f}"
        f"{' (counted on the modules)' if m.activations_counted else ''} for {m.in_flight} "
        f"micro-batch(es) in flight). Knobs in the order to try them:"
    )
    options = reference_knobs(plan.cfg) + _batch_knobs(plan) + _state_knobs(plan)
    lines = []
    for text, change in options:
        alt = _variant(plan, **change)
        if alt is None:
            continue
        saved = _worst(plan) - _worst(alt)
        if saved < 0.01 * _worst(plan):
            continue  # e.g. fewer micro-batches under 1F1B: the number in flight does not change
        verdict = "fits" if alt.fits else "still does not fit"
        lines.append(f"  - {text}: saves {saved / GIB:.1f} GiB -> {_worst(alt) / GIB:.1f} GiB, {verdict}")
    return [Finding("error", "\n".join([head, *lines]))]


def bubble_findings(plan: Plan) -> list[Finding]:
    pc = plan.cfg.parallel_config
    bubble = plan.throughput.bubble_fraction
    if pc.pipeline_stage == 1 or bubble <= 0.10:
        return []
    p = pc.pipeline_stage
    v = pc.pp_interleave_num if pc.pipeline_schedule not in ("gpipe", "1f1b") else 1
    need = math.ceil(9 * (p - 1) / v)  # (p - 1) / (v m + p - 1) <= 0.1
    need = max(need, p)
    return [
        Finding(
            "warning",
            f"pipeline bubble {bubble:.0%} (> 10%) with micro_batch_num {pc.micro_batch_num} over "
            f"{p} stages: parallel_config.micro_batch_num: {need} brings it to "
            f"{(p - 1) / (v * need + p - 1):.0%} (rule of thumb: 4-8x the stages)",
        )
    ]


def topology_findings(plan: Plan) -> list[Finding]:
    per_node = plan.dims.world_size // max(1, plan.nodes)
    if plan.dims.tp > per_node:
        return [
            Finding(
                "warning",
                f"model_parallel {plan.dims.tp} spans nodes ({per_node} devices per node): tensor "
                f"parallelism communicates every layer; keep it inside a node and use pipeline_stage across "
                f"nodes",
            )
        ]
    return []


def target_findings(plan: Plan, target_samples_per_s: float | None) -> list[Finding]:
    if not target_samples_per_s:
        return []
    mc = plan.cfg.model.model_config
    t = plan.throughput
    need = target_samples_per_s * mc.seq_length * t.flops_per_token
    low = mc.compute_dtype != "float32"
    have = plan.dims.world_size * (plan.accelerator.peak_bf16 if low else plan.accelerator.peak_fp32)
    arithmetic = (
        f"{target_samples_per_s:,.0f} samples/s x {mc.seq_length} tokens x {t.flops_per_token / 1e9:.1f} GFLOP/token "
        f"= {need / 1e15:,.1f} PFLOP/s of model FLOPs; {plan.dims.world_size} x {plan.accelerator.name} peak "
        f"{have / 1e15:,.2f} PFLOP/s"
    )
    if not low:
        bf16 = plan.dims.world_size * plan.accelerator.peak_bf16
        arithmetic += f" in fp32 ({bf16 / 1e15:,.2f} PFLOP/s in bf16: {need / bf16:,.0f}x short even there)"
    if need > have:
        return [
            Finding(
                "error",
                f"throughput target impossible: {arithmetic}, so even at 100% MFU it needs "
                f"{need / have:,.0f}x the hardware; the planner predicts {t.samples_per_s:,.1f} samples/s "
                f"(MFU {t.mfu:.0%})",
            )
        ]
    if t.samples_per_s < target_samples_per_s:
        return [
            Finding(
                "warning",
                f"throughput target above the prediction: {arithmetic} ({need / have:.0%} of peak); "
                f"predicted {t.samples_per_s:,.1f} samples/s",
            )
        ]
    return []


def precision_findings(plan: Plan) -> list[Finding]:
    mc = plan.cfg.model.model_config
    if mc.compute_dtype == "float32" and plan.accelerator.name != "cpu":
        return [
            Finding(
                "warning",
                "model.model_config.compute_dtype is float32: bfloat16 (with layernorm and "
                "softmax in float32) halves activation memory and runs the matmuls "
                f"{plan.accelerator.peak_bf16 / plan.accelerator.peak_fp32:.0f}x faster on "
                f"{plan.accelerator.name}",
            )
        ]
    return []


COMPUTE_BOUND = 0.5  # share of the step spent computing above which faster matmuls shorten it most


def fp8_findings(plan: Plan) -> list[Finding]:
    """A bf16 run whose step is mostly compute, on a device with FP8 units: FP8 linears, if the planner finds them
    faster for this model's shapes."""
    mc, t, acc = plan.cfg.model.model_config, plan.throughput, plan.accelerator
    if plan.cfg.fp8_config.enable or mc.compute_dtype != "bfloat16" or acc.peak_fp8 is None:
        return []
    busy = t.compute_s / (1 - t.bubble_fraction) / t.step_time_s
    if busy < COMPUTE_BOUND:
        return []
    fp8 = _variant(plan, **{"fp8_config.enable": True})
    if fp8 is None or fp8.throughput.step_time_s >= t.step_time_s:
        return []
    ft = fp8.throughput
    return [
        Finding(
            "warning",
            f"compute-bound ({busy:.0%} of the step is compute) on {acc.name}, which has FP8 units: "
            f"fp8_config.enable: true runs {ft.fp8_share:.0%} of the FLOPs in FP8 linears: predicted "
            f"{t.step_time_s:.3g} -> {ft.step_time_s:.3g} s/step ({t.step_time_s / ft.step_time_s:.2f}x)",
        )
    ]


def _ep_choices(plan: Plan) -> list[int]:
    """expert_parallel degrees above the current one that divide the experts and the ranks ep may borrow
    (dp_shard x cp, with optimizer sharding over all of data_parallel where the run does not shard yet)."""
    pc, m = plan.cfg.parallel_config, plan.cfg.model.model_config.moe_config
    borrowable = (plan.dims.dp_shard if plan.dims.dp_shard > 1 else pc.data_parallel) * plan.dims.cp
    return [n for n in range(pc.expert_parallel + 1, borrowable + 1) if borrowable % n == 0 and m.expert_num % n == 0]


def _ep_change(plan: Plan, ep: int) -> tuple[str, dict]:
    """(the advice's text, the config change) that raises expert_parallel to `ep`."""
    change = {"parallel_config.expert_parallel": ep}
    text = f"parallel_config.expert_parallel: {ep}"
    if plan.dims.dp_shard == 1:  # ep borrows parameter-sharding ranks
        change["parallel_config.optimizer_shard"] = True
        text += " with optimizer_shard: true"
    return text, change


def expert_findings(plan: Plan) -> list[Finding]:
    """Expert parallelism: (1) the routed experts' states dominate a rank's memory and a larger `ep` divides them;
    (2) the all-to-all of `ep` takes a large share of the step (over the network when ep x tp spans nodes)."""
    moe = plan.moe
    if moe is None:
        return []
    out = []
    states = max(plan.stages, key=lambda st: st.memory.states_bytes).memory
    per_param = states.states_bytes / max(1, states.params_bytes // 4)  # bytes of states per fp32 parameter
    experts = moe.routed_params_per_rank * per_param
    choices = _ep_choices(plan)
    if experts > 0.5 * _worst(plan) and choices:
        ep = choices[-1]
        text, change = _ep_change(plan, ep)
        alt = _variant(plan, **change)
        after = (
            f" -> {_worst(alt) / GIB:.1f} GiB per rank, {'fits' if alt.fits else 'still does not fit'}" if alt else ""
        )
        out.append(
            Finding(
                "warning",
                f"routed experts hold {experts / GIB:.1f} GiB of parameters, gradients and optimizer states per rank "
                f"({experts / _worst(plan):.0%} of its {_worst(plan) / GIB:.1f} GiB): {text} keeps "
                f"{plan.cfg.model.model_config.moe_config.expert_num // ep} experts of each layer per rank{after}",
            )
        )
    t = plan.throughput
    if plan.dims.ep > 1 and t.ep_s > 0.25 * t.compute_s:
        per_node = plan.dims.world_size // max(1, plan.nodes)
        where = (
            "over the network (ep x model_parallel spans nodes)"
            if plan.dims.ep * plan.dims.tp > per_node
            else "inside the node"
        )
        bw = plan.accelerator.inter_bw if "network" in where else plan.accelerator.intra_bw
        out.append(
            Finding(
                "warning",
                f"expert parallelism's all-to-all moves {t.ep_bytes / 1e9:.1f} GB per rank and step {where} at "
                f"{bw / 1e9:.0f} GB/s: {t.ep_s:.2f} s on the critical path against {t.compute_s:.2f} s of compute; "
                f"keep expert_parallel x model_parallel within a node ({per_node} devices), or lower expert_parallel "
                f"(a share (ep - 1) / ep of the routed rows leaves each rank)",
            )
        )
    return out


def context_findings(plan: Plan) -> list[Finding]:
    """Recompute on a layout that context parallelism (cp 2 on half the data-parallel ranks, recompute off) would fit
    faster: the two knobs that pay for a long sequence's activations, compared on the planner's figures."""
    cfg, pc, rc = plan.cfg, plan.cfg.parallel_config, plan.cfg.recompute_config
    if pc.context_parallel != 1 or pc.data_parallel % 2 or not (rc.recompute or rc.select_recompute):
        return []
    change = {
        "parallel_config.context_parallel": 2,
        "parallel_config.data_parallel": pc.data_parallel // 2,
        "recompute_config.recompute": False,
        "recompute_config.select_recompute": False,
    }
    plain = _variant(plan, **{k: v for k, v in change.items() if k.startswith("recompute_config")})
    if plain is not None and plain.fits:  # recompute is not needed at all: nothing to trade it for
        return []
    alt = _variant(plan, **change)
    if alt is None or not alt.fits:
        return []
    now, then = plan.throughput.tokens_per_s, alt.throughput.tokens_per_s
    if then <= now:
        return []
    return [
        Finding(
            "warning",
            f"seq_length {cfg.model.model_config.seq_length} with recompute: parallel_config.context_parallel: 2, "
            f"data_parallel: {pc.data_parallel // 2} and recompute off fits ({_worst(alt) / GIB:.1f} GiB per rank) "
            f"and is predicted {then / now - 1:.0%} faster ({then:,.0f} against {now:,.0f} tokens/s): splitting the "
            f"sequence halves a rank's activations for a K/V all-gather of {alt.throughput.cp_bytes / 1e9:.1f} GB per "
            f"step, where recompute repeats each layer's forward",
        )
    ]


def reference_findings(plan: Plan) -> list[str]:
    """A preference run with `reference: copy` that does not fit: which other reference makes it fit (`plan` prints
    these; `doctor` lists them first among its memory knobs)."""
    if plan.fits:
        return []
    lines = []
    for text, change in reference_knobs(plan.cfg):
        alt = _variant(plan, **change)
        if alt is not None and alt.fits:
            lines.append(f"fits with {text}: {_worst(alt) / GIB:.1f} GiB per rank")
    return lines


def diagnose(plan: Plan, target_samples_per_s: float | None = None) -> list[Finding]:
    return [
        *memory_findings(plan),
        *expert_findings(plan),
        *context_findings(plan),
        *bubble_findings(plan),
        *topology_findings(plan),
        *target_findings(plan, target_samples_per_s),
        *precision_findings(plan),
        *fp8_findings(plan),
    ]
