#!/usr/bin/env python
"""Training throughput of a Qwen3-MoE-shaped model on one device: routed experts by grouped matmuls
(`torch._grouped_mm`) against the per-expert loop, tokens/s and MFU against ACTIVE FLOPs.

Each expert mode builds the model with the trainer's own functions (train/step.py), trains it on random tokens
for `--steps` timed steps after `--warmup`, and prints tokens/s, MFU (model FLOPs per token as the planner and the
trainer count them for MoE: 6 x active parameters, top-k of the routed experts, + the attention term; models/
registry.py), the step time, the first and last loss (the two modes start from the same weights and data, so
their losses agree), and what `meshformer plan` predicts. `--dtype bfloat16` stores and computes in bf16 (the
routed experts' grouped matmuls then run in bf16; under autocast with fp32 master weights they would take the
weights' dtype). The peak is the device's data sheet (a GPU the planner knows) or a timed matmul (a CPU).

    python bench/moe.py --preset qwen3_moe --layers 8 --seq 4096 --batch 1 --dtype bfloat16     # one GPU
    python bench/moe.py --preset tiny --seq 64 --batch 2 --steps 2 --dtype float32              # CPU: cannot rot
    python bench/moe.py --preset small --seq 256 --batch 4 --steps 20 --layer-only               # one layer, best of N

`--layer-only` times one layer's routed experts alone, grouped and looped in turn, best of N: on a machine shared
with other work a whole step's median moves several-fold between runs, the best of interleaved repeats does not.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

QWEN3_ATTN = dict(num_heads=32, n_kv_heads=4, head_dim=128, use_qk_norm=True, theta=1000000.0, rms_norm_eps=1e-6)
PRESETS = {  # Qwen3-30B-A3B's layer (fewer layers fit one device); tiny for CPU runs
    "qwen3_moe": dict(
        hidden_size=2048, num_layers=48, intermediate_size=6144, vocab_size=151936, **QWEN3_ATTN,
        moe=dict(expert_num=128, num_experts_chosen=8, moe_intermediate_size=768),
    ),
    "small": dict(
        hidden_size=512, num_layers=4, num_heads=8, n_kv_heads=4, head_dim=64, use_qk_norm=True,
        intermediate_size=1536, vocab_size=8192,
        moe=dict(expert_num=32, num_experts_chosen=4, moe_intermediate_size=256),
    ),
    "tiny": dict(
        hidden_size=128, num_layers=2, num_heads=4, n_kv_heads=2, head_dim=32, use_qk_norm=True,
        intermediate_size=384, vocab_size=2048, moe=dict(expert_num=8, num_experts_chosen=2, moe_intermediate_size=128),
    ),
}  # fmt: skip
EXPERTS = {"grouped": "true", "loop": "false"}  # moe_config.use_gmm


def config_args(args, experts: str) -> list[str]:
    shape = dict(PRESETS[args.preset])
    moe = shape.pop("moe")
    if args.layers:
        shape["num_layers"] = args.layers
    model = {**shape, "type": "Qwen3MoeConfig", "seq_length": args.seq}
    model |= {"compute_dtype": args.dtype, "param_init_type": args.dtype}
    flat = [x for k, v in model.items() for x in (f"--model.model_config.{k}", str(v))]
    flat += [x for k, v in moe.items() for x in (f"--model.model_config.moe_config.{k}", str(v))]
    flat += ["--model.model_config.moe_config.use_gmm", EXPERTS[experts]]
    return [*flat, "--train_dataset.batch_size", str(args.batch), "--compile", "false", "--seed", "0"]


def run_experts(args, experts: str, peak: tuple[float, str]) -> dict:
    from gpu_train import accelerator_for, device_name
    from meshformer.config.load import load_config
    from meshformer.parallel import init_parallel
    from meshformer.planner.plan import make_plan
    from meshformer.train.optim import Optimizers
    from meshformer.train.step import build_parts, train_step

    cfg = load_config(None, config_args(args, experts))
    env = init_parallel(cfg)
    dev, mc = env.device, cfg.model.model_config
    built = build_parts(cfg, env)
    opt = Optimizers(built.parts.parts, cfg)
    plan = make_plan(cfg, env.dims, accelerator_for(dev), args.batch, 1)
    peak, source = peak
    g = torch.Generator(dev).manual_seed(0)
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(mc.vocab_size, (args.batch, args.seq + 1), generator=g, device=dev)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        res = train_step(
            built.parts, opt, env, tokens[:, :-1], tokens[:, 1:], n_micro=1, ignore_index=-100, max_grad_norm=1.0
        )
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(res.loss)
    step_s = statistics.median(times)
    tok_s = args.batch * args.seq / step_s
    t, moe = plan.throughput, plan.moe
    row = {
        "experts": experts,
        "device": device_name(dev),
        "preset": args.preset,
        "layers": mc.num_layers,
        "seq": args.seq,
        "micro_batch": args.batch,
        "dtype": args.dtype,
        "total_params": moe.total_params,
        "active_params": moe.active_params,
        "flops_per_token": t.flops_per_token,
        "step_s": step_s,
        "tokens_per_s": tok_s,
        "peak_flops": peak,
        "peak_source": source,
        "mfu": t.flops_per_token * tok_s / peak,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "predicted_tokens_per_s": t.tokens_per_s,
    }
    if dev.type == "cuda":
        row["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(dev)
    del built, opt
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return row


def experts_alone(args) -> list[dict]:
    """One layer's routed experts, forward + backward on the rows the preset routes (batch x seq x k, spread
    evenly at random), grouped and looped in turn `--steps` times: the best time of each (robust to a busy
    machine, where a whole step's median is not), and its FLOP/s (18 R h F: three matmuls, forward and backward)."""
    from meshformer.models.moe.experts import GroupedExperts
    from meshformer.parallel.env import local_device

    dev, dt = local_device(), getattr(torch, args.dtype)
    shape = PRESETS[args.preset]
    E, k, F = (shape["moe"][n] for n in ("expert_num", "num_experts_chosen", "moe_intermediate_size"))
    h, R = shape["hidden_size"], args.batch * args.seq * k
    g = torch.Generator().manual_seed(0)
    counts = torch.multinomial(torch.ones(E), R, replacement=True, generator=g).bincount(minlength=E).to(dev)
    x = torch.randn(R, h, generator=g).to(dev, dt).requires_grad_(True)
    mods = {}
    for name, use in (("grouped", True), ("loop", False)):
        torch.manual_seed(0)
        mods[name] = GroupedExperts(E, h, F, use_gmm=use).to(dev, dt)
        for p in mods[name].parameters():
            torch.nn.init.normal_(p, std=0.02)
    best = {name: float("inf") for name in mods}
    for _ in range(args.warmup + args.steps):
        for name, m in mods.items():
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            y = m(x, counts)
            y.backward(torch.ones_like(y))
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            best[name] = min(best[name], time.perf_counter() - t0)
    flops = 18 * R * h * F
    return [
        {"experts": name, "layer_only": True, "preset": args.preset, "dtype": args.dtype, "rows": R, "best_s": s,
         "tflop_per_s": flops / s / 1e12}
        for name, s in best.items()
    ]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3_moe", choices=sorted(PRESETS))
    ap.add_argument("--layers", type=int, default=0, help="override the preset's layer count (0: keep)")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--experts", default="grouped,loop", help="comma-separated, of grouped, loop")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per mode")
    ap.add_argument("--peak-flops", type=float, default=0, help="the device's peak FLOP/s (0: data sheet or timed)")
    ap.add_argument("--json", default="", help="append one JSON line per mode to this file")
    ap.add_argument("--layer-only", action="store_true", help="time one layer's routed experts alone (best of N)")
    args = ap.parse_args()
    if args.layer_only:
        rows = experts_alone(args)
        for row in rows:
            print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
        g, lp = rows
        print(f"one layer's experts, {g['rows']:,} rows, {args.dtype}: grouped {g['best_s'] * 1e3:.1f} ms "
              f"({g['tflop_per_s']:.3f} TFLOP/s), loop {lp['best_s'] * 1e3:.1f} ms ({lp['tflop_per_s']:.3f} TFLOP/s): "
              f"{lp['best_s'] / g['best_s']:.2f}x")  # fmt: skip
        return
    from meshformer.backends.peaks import peak_flops
    from meshformer.dtypes import DTYPE
    from meshformer.parallel.env import local_device

    peak = peak_flops(local_device(), DTYPE[args.dtype], args.peak_flops)
    rows = []
    for experts in args.experts.split(","):
        if experts not in EXPERTS:
            raise SystemExit(f"--experts: {experts!r} is not one of {', '.join(EXPERTS)}")
        try:
            row = run_experts(args, experts, peak)
        except Exception as e:  # one mode failing (out of memory, a kernel's gap) must not hide the other
            row = {"experts": experts, "preset": args.preset, "error": f"{type(e).__name__}: {str(e)[:200]}"}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    ok = [r for r in rows if "error" not in r]
    if ok:
        r = ok[0]
        print(
            f"\n{r['device']}; torch {torch.__version__}; {r['total_params'] / 1e6:,.1f}M parameters, "
            f"{r['active_params'] / 1e6:,.1f}M active, {r['flops_per_token'] / 1e6:,.1f} MFLOP/token; peak "
            f"{r['peak_flops'] / 1e12:.3f} TFLOP/s ({r['peak_source']})"
        )
    print("| preset | layers | seq x batch | dtype | experts | tokens/s | MFU (active) | step s | loss first -> last |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['preset']} | | | | {r['experts']} | {r['error']} |")
            continue
        print(
            f"| {r['preset']} | {r['layers']} | {r['seq']} x {r['micro_batch']} | {r['dtype']} | {r['experts']} | "
            f"{r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | {r['step_s']:.3f} | "
            f"{r['loss_first']:.4f} -> {r['loss_last']:.4f} |"
        )
    if len(ok) == 2:
        print(f"grouped / loop tokens/s: {ok[0]['tokens_per_s'] / ok[1]['tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()
