"""`meshformer plan --explain`: every formula of the plan with its numbers substituted (planner/ has the code)."""

from __future__ import annotations

from meshformer.models.registry import family_of
from meshformer.planner.plan import FRAGMENTATION, Plan

GIB = 1 << 30


def _g(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def _stage_lines(plan: Plan, T: int) -> list[str]:
    """Each pipeline rank's memory, term by term."""
    mc, dims, tp = plan.cfg.model.model_config, plan.dims, plan.dims.tp
    lines: list[str] = []
    for s in plan.stages:
        m = s.memory
        runtime = plan.accelerator.runtime(plan.dims)
        resident = s.resident_bytes
        lines += [
            f"pipeline rank {m.stage}: {m.layers} layers",
            f"  weights {_g(m.params_bytes)}, gradients {_g(m.grads_bytes)} (trainable only), AdamW 2 moments + "
            f"steps {_g(m.optimizer_bytes)}; divided by tp {tp}, pp (this rank's layers), FSDP {dims.dp_shard}",
            f"  activations {_g(m.activations_bytes)} = {m.in_flight} micro-batch(es) in flight x the layers' sets "
            f"(+ last stage's norm and log-softmax T*V/t*4 = {_g(T * mc.vocab_size // tp * 4)}, a distillation "
            f"loss's saved tensors instead; + receive buffers)",
            f"  + logits {_g(s.logits_bytes)}, autocast's cached weight copies of recomputed layers "
            f"{_g(m.autocast_cache_bytes)}, recompute working set {_g(m.recompute_bytes)}, FSDP gathers "
            f"{_g(s.fsdp_gathered_bytes)}; AdamW step temporaries {_g(s.optimizer_step_bytes)}",
            f"  allocated = weights + AdamW states + max(activations + FSDP + max(logits + cached copies, recompute) "
            f"[+ gradients "
            f"when accumulating or pipelining], gradients + AdamW temporaries) = {_g(s.allocated_bytes)}",
            f"  reserved = resident {_g(resident)} + (allocated - resident) x "
            f"{1 + FRAGMENTATION[plan.throughput.compiled]:.3f} ({'compiled' if plan.throughput.compiled else 'eager'}"
            f") = {_g(s.reserved_bytes)}; + runtime {_g(runtime)}; device {_g(plan.device_memory)}: headroom "
            f"{_g(s.headroom_bytes)}",
        ]
    return lines


def _efficiency_formula(plan: Plan) -> str:
    acc, t = plan.accelerator, plan.throughput
    if not acc.hbm_bw:
        return f": {acc.name}'s figure"
    peak = acc.peak_fp32 if plan.cfg.model.model_config.compute_dtype == "float32" else acc.peak_bf16
    per_flop = (1 / t.efficiency - 1 / acc.gemm_efficiency) * acc.hbm_bw / peak
    return (
        f" = 1 / (1 / matmuls {acc.gemm_efficiency} + element-wise {per_flop:.5f} bytes per FLOP x peak "
        f"{peak / 1e12:.0f} TFLOP/s / HBM {acc.hbm_bw / 1e12:.2f} TB/s), {'compiled' if t.compiled else 'eager'}"
    )


def explain(plan: Plan) -> list[str]:
    cfg, dims, t = plan.cfg, plan.dims, plan.throughput
    mc, pc = cfg.model.model_config, cfg.parallel_config
    a = 2 if mc.compute_dtype != "float32" else 4
    n = 4 if mc.layernorm_compute_dtype == "float32" else 2
    T = plan.micro_batch * mc.seq_length
    h, f = mc.hidden_size, mc.ffn_hidden_size
    q, kv = mc.num_heads * mc.dim_per_head, mc.num_kv_heads * mc.dim_per_head
    N = family_of(mc).param_count(mc)
    tp, sp = dims.tp, pc.use_seq_parallel and dims.tp > 1
    lines = [
        f"parameters N = {N:,} ({mc.num_layers} layers x (attention h*q + 2*h*kv + q*h + SwiGLU 3*h*f + 2 norms) "
        f"+ embedding{'' if mc.tie_word_embeddings else ' and head'} V*h + final norm)",
        f"tokens per micro-batch T = micro batch {plan.micro_batch} x seq_length {mc.seq_length} = {T:,}; "
        f"element sizes: compute a = {a} B, norms n = {n} B",
    ]
    if any(s.memory.activations_counted for s in plan.stages):  # the family has no activation model
        lines.append(
            "per layer: counted, not a formula: one forward of the real modules on fake tensors, the distinct "
            "storages saved for backward (planner/counted_activations.py)"
        )
    else:
        lines += [
            f"per layer, no recompute (T={T:,}, h={h}, q={q}, kv={kv}, f={f}, t={tp}{', SP' if sp else ''}):",
            f"  2 RMSNorms  2 x (2*T*h*n + T*n){' / t' if sp else ''} = "
            f"{_g(2 * (2 * T * h * n + T * n) // (tp if sp else 1))}; their outputs read by the linears 2 x T*h*a = "
            f"{_g(2 * T * h * a)}",
            f"  attention   (2*T*q + 2*T*kv)*a/t + 4*T*heads/t = "
            f"{_g((2 * T * q + 2 * T * kv) * a // tp + 4 * T * mc.num_heads // tp)}",
            f"  SwiGLU      4*T*f*a/t = {_g(4 * T * f * a // tp)}",
        ]
    lines += _stage_lines(plan, T)
    embedding = mc.vocab_size * h
    moe = plan.moe
    if moe is not None:
        k, E = mc.moe_config.num_experts_chosen, mc.moe_config.expert_num
        rows = T * k
        lines += [
            f"MoE: routed experts {moe.routed_params:,} of N over {moe.moe_layers} layers; active parameters N_active "
            f"= N - routed x (1 - k/E) = {N:,} - {moe.routed_params:,} x (1 - {k}/{E}) = {moe.active_params:,}",
            f"  experts per rank = E / ep = {E} / {dims.ep} = {moe.experts_per_rank}, routed parameters per rank "
            f"{moe.routed_params_per_rank:,} (FSDP over efsdp {dims.efsdp if dims.ep > 1 else dims.dp_shard})",
            f"  all-to-all = (4 [+2 recompute, +2 routing pre-pass]) x MoE layers per rank x micro-batches x T*k*h*a x "
            f"(ep-1)/ep = {t.ep_bytes / 1e9:.2f} GB in {t.ep_s:.3f} s; buffers 2*T*k*h*a = "
            f"{_g(moe.a2a_buffer_bytes)} (T*k = {rows:,} rows)",
        ]
    counted = moe.active_params if moe is not None else N
    attn = family_of(mc).attention_cost(mc)  # the family's attention term (latent attention: q/k and v widths)
    lines += [
        f"FLOPs per token = 6 x (N{'_active' if moe else ''} - V*h) + attention {attn.formula} = 6 x "
        f"{counted - embedding:,} + {attn.numbers} = {t.flops_per_token / 1e9:.2f} GFLOP "
        f"(causal not halved)",
        f"model FLOPs per step = {t.flops_per_token / 1e9:.2f} GFLOP x {t.flops_per_step / t.flops_per_token:,.0f} "
        f"tokens = {t.flops_per_step / 1e15:.3f} PFLOP; with recompute's extra forward (and a routing pre-pass) "
        f"{t.hardware_flops_per_step / 1e15:.3f}",
        f"compute per rank = hardware FLOPs / {dims.world_size} devices / (peak x {t.efficiency:.3f}"
        f"{_efficiency_formula(plan)}) + the optimizer step's device memory traffic = {t.compute_s:.3f} s; "
        f"bubble (p-1)/(v*m+p-1) = {t.bubble_fraction:.1%}",
        f"communication per rank: tp {t.tp_bytes / 1e9:.2f} GB in {t.tp_s:.3f} s, dp {t.dp_bytes / 1e9:.2f} GB in "
        f"{t.dp_s:.3f} s (hidden behind 80% of compute), pp {t.pp_bytes / 1e9:.2f} GB in {t.pp_s:.3f} s, cp (K/V "
        f"gathers) {t.cp_bytes / 1e9:.2f} GB in {t.cp_s:.3f} s",
        f"activation swap: {t.swap_bytes / 1e9:.2f} GB each way over {plan.accelerator.host_bw / 1e9:.0f} GB/s, "
        f"overlapping forward (1/3 of compute) and backward (2/3): {t.swap_s:.3f} s on the critical path",
        f"step = compute / (1 - bubble) + tp + pp + ep + cp + swap + max(0, dp - 0.8 x compute) = "
        f"{t.step_time_s:.3f} s -> {t.tokens_per_s:,.0f} tokens/s, MFU {t.mfu:.1%}",
    ]
    return lines
