#!/usr/bin/env python
"""Training throughput and memory of Llama-shaped models on this machine's accelerators, next to the planner's.

One process per device (torchrun for several: data parallel over all of them, `--fsdp` to shard the states).
Each mode (none / selective / full recompute, swap) builds the model with the trainer's own functions
(train/step.py), trains it on random tokens for `--steps` steps after `--warmup`, and prints per device: tokens/s,
MFU against the data-sheet peak (FLOPs per token as the planner counts them: 6 x non-embedding parameters, output
projection included, + 12 x layers x hidden x seq), peak allocated and reserved memory (the CUDA allocator's; on a
CPU the activation counter's figure stands in), and what `meshformer plan` predicts for the same run.

    python bench/gpu_train.py --preset 1b --seq 2048 --batch 4 --modes none,selective,full,swap
    torchrun --nproc-per-node 8 bench/gpu_train.py --preset 8b --seq 2048 --batch 1 --fsdp --modes selective
    python bench/gpu_train.py --preset tiny --seq 128 --batch 2 --steps 2   # CPU: the script cannot rot
    python bench/gpu_train.py --preset 8b --seq 2048 --batch 1 --qlora --modes full   # QLoRA memory on one GPU
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

PRESETS = {  # Llama 3.2 1B and Llama 3.1 8B shapes; tiny for CPU smoke runs
    "tiny": dict(hidden_size=256, num_layers=4, num_heads=4, n_kv_heads=2, intermediate_size=704, vocab_size=4096),
    "1b": dict(
        hidden_size=2048,
        num_layers=16,
        num_heads=32,
        n_kv_heads=8,
        intermediate_size=8192,
        vocab_size=128256,
        theta=500000.0,
        tie_word_embeddings=True,
    ),
    "8b": dict(
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        n_kv_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        theta=500000.0,
    ),
}
LINEARS = "[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"
EAGER = ["--compile", "false"]  # explicit: `compile: auto` would compile these on a GPU
MODES = {
    "none": EAGER,
    "selective": [*EAGER, "--recompute_config.select_recompute", "true"],
    "full": [*EAGER, "--recompute_config.recompute", "true"],
    "swap": [*EAGER, "--swap_config.swap", "true"],
    "compiled": ["--compile", "true"],
    "compiled_selective": ["--compile", "true", "--recompute_config.select_recompute", "true"],
}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    from finetune_memory import cpu

    return cpu()


def accelerator_for(device: torch.device):
    from meshformer.planner.accelerators import ACCELERATORS, find_accelerator

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key in ACCELERATORS:
            if key in name:
                return ACCELERATORS[key]
    return find_accelerator("cpu")


def run_mode(args, mode: str, acc) -> dict:
    from meshformer.config.load import load_config
    from meshformer.parallel import init_parallel
    from meshformer.planner.plan import make_plan
    from meshformer.train.hooks import StepContext
    from meshformer.train.memory import counter_for
    from meshformer.train.metrics import tensor_bytes
    from meshformer.train.optim import Optimizers
    from meshformer.train.step import build_parts, train_step

    world = int(os.environ.get("WORLD_SIZE", "1"))
    model = {**PRESETS[args.preset], "seq_length": args.seq, "compute_dtype": args.dtype}
    if args.layers:
        model["num_layers"] = args.layers
    flat = [x for k, v in model.items() for x in (f"--model.model_config.{k}", str(v))]
    flat += ["--parallel_config.data_parallel", str(world), "--train_dataset.batch_size", str(args.batch)]
    if args.fsdp:
        flat += ["--parallel_config.optimizer_shard", "true"]
    if args.fp8:  # the decoder's linears in FP8 (fp8_config); on GPUs under FSDP the weights gather in FP8 too
        flat += ["--fp8_config.enable", "true", "--fp8_config.recipe", args.fp8]
        if args.fsdp and args.fp8 == "tensorwise" and torch.cuda.is_available():
            flat += ["--fp8_config.enable_fsdp_float8_all_gather", "true"]
    if args.qlora:  # LoRA on every decoder linear over their NF4 base (models/qlora.py)
        flat += ["--model.model_config.pet_method", "qlora", "--model.model_config.pet_config.target_modules", LINEARS]
    cfg = load_config(None, flat + MODES[mode])
    env = init_parallel(cfg)
    dev = env.device
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    t_build = time.perf_counter()
    built = build_parts(cfg, env)
    opt = Optimizers(built.parts.parts, cfg)
    t_build = time.perf_counter() - t_build
    plan = make_plan(cfg, env.dims, acc, args.batch, 1)
    g = torch.Generator(dev).manual_seed(env.rank)
    vocab = cfg.model.model_config.vocab_size
    times, losses, act_peak = [], [], 0
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(vocab, (args.batch, args.seq + 1), generator=g, device=dev)
        counter = counter_for(built.parts) if dev.type != "cuda" and step == args.warmup else None
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            if step == 1:  # after the first step: optimizer states exist, the peak is a steady step's
                torch.cuda.reset_peak_memory_stats(dev)
        t0 = time.perf_counter()
        res = train_step(
            built.parts,
            opt,
            env,
            tokens[:, :-1],
            tokens[:, 1:],
            n_micro=1,
            ignore_index=-100,
            max_grad_norm=1.0,
            hooks=[StepContext(counter.hooks())] if counter is not None else [],
        )
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(res.loss)
        if counter is not None:
            act_peak = counter.peak
    step_s = statistics.median(times)
    tok_s = args.batch * args.seq / step_s
    t = plan.throughput
    st = plan.stages[0]
    out = {
        "mode": mode,
        "device": device_name(dev),
        "world": world,
        "preset": args.preset,
        "layers": cfg.model.model_config.num_layers,
        "seq": args.seq,
        "micro_batch": args.batch,
        "dtype": args.dtype,
        "fsdp": args.fsdp,
        "fp8": args.fp8 or None,
        "fp8_note": built.parts.fp8_note,
        "qlora": args.qlora,
        "params_bytes": tensor_bytes(built.parts.parameters()),  # this device's: NF4 codes and scales included
        "predicted_params_bytes": st.memory.params_bytes,
        "build_s": round(t_build, 2),
        "step_s": step_s,
        "tokens_per_s_per_device": tok_s,
        "mfu": t.flops_per_token * tok_s / (acc.peak_bf16 if args.dtype != "float32" else acc.peak_fp32),
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "predicted_tokens_per_s": t.tokens_per_s / env.dims.world_size,
        "predicted_allocated_bytes": st.allocated_bytes,
        "predicted_reserved_bytes": st.reserved_bytes,
        "predicted_states_bytes": st.memory.states_bytes,
        "predicted_activations_bytes": st.memory.activations_bytes,
        "predicted_host_bytes": st.host_bytes,
    }
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        out |= {
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(dev),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(dev),
            # what the process holds outside the caching allocator: CUDA context, cuBLAS/NCCL workspaces
            "outside_allocator_bytes": total - free - torch.cuda.memory_reserved(dev),
        }
        swap = getattr(built.parts.parts[0], "activation_swap", None)
        if swap is not None:
            out["swapped_bytes_per_step"] = swap.offloaded_bytes / (args.warmup + args.steps)
    else:
        out["activations_bytes"] = act_peak
    del built, opt
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="1b", choices=sorted(PRESETS))
    ap.add_argument("--layers", type=int, default=0, help="override the preset's layer count (0: keep)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1, help="micro batch per device (one micro-batch per step)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--modes", default="selective", help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--fsdp", action="store_true", help="shard parameters, gradients and states (FSDP2)")
    ap.add_argument(
        "--fp8",
        default="",
        choices=("", "tensorwise", "rowwise", "rowwise_with_gw_hp"),
        help="train the decoder's linears in FP8 with this recipe (fp8_config; needs --dtype bfloat16)",
    )
    ap.add_argument("--qlora", action="store_true", help="QLoRA: adapters on every linear over an NF4 base")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per mode")
    ap.add_argument("--budget-s", type=float, default=0, help="start no further mode after this many seconds")
    ap.add_argument("--json", default="", help="append one JSON line per mode to this file")
    args = ap.parse_args()
    modes = args.modes.split(",")
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"--modes: {m!r} is not one of {', '.join(MODES)}")
    from meshformer.parallel.env import local_device

    acc = accelerator_for(local_device())
    start, rows = time.perf_counter(), []
    for mode in modes:
        if args.budget_s and time.perf_counter() - start > args.budget_s:
            print(f"skipped {mode}: over --budget-s", flush=True)
            continue
        try:
            row = run_mode(args, mode, acc)
        except Exception as e:  # one mode failing (out of memory, a torch version's gap) must not hide the others
            row = {"mode": mode, "preset": args.preset, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json and int(os.environ.get("RANK", "0")) == 0:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    if int(os.environ.get("RANK", "0")) != 0:
        return
    gib = 2**30
    print(f"\n{rows[0].get('device', '?')}; torch {torch.__version__}; accelerator {acc.name}")
    print(
        "| preset | layers | seq x batch | mode | tokens/s/device | planner | MFU | peak alloc | planner | reserved "
        "| planner |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['preset']} | | | {r['mode']} | {r['error']} |")
            continue
        alloc = r.get("peak_allocated_bytes", r.get("activations_bytes", 0))
        print(
            f"| {r['preset']} | {r['layers']} | {r['seq']} x {r['micro_batch']} | {r['mode']}"
            f"{' fp8 ' + r['fp8'] if r.get('fp8') else ''} | "
            f"{r['tokens_per_s_per_device']:,.0f} | {r['predicted_tokens_per_s']:,.0f} | {r['mfu']:.1%} | "
            f"{alloc / gib:.2f} GiB | {r['predicted_allocated_bytes'] / gib:.2f} GiB | "
            f"{r.get('peak_reserved_bytes', 0) / gib:.2f} GiB | {r['predicted_reserved_bytes'] / gib:.2f} GiB |"
        )


if __name__ == "__main__":
    main()
