#!/usr/bin/env python
"""Activation memory and step time of no, full and selective recompute on one model, in one process and run.

Each mode builds the same model (seeded) with the trainer's own functions (train/step.py) and trains it on the same
random tokens; modes take turns step by step, so a busy machine slows them alike. Activations are the peak of the
bytes kept for backward (train/memory.py's counter: autograd's saved tensors and what selective recompute keeps);
the planner's prediction (planner/memory.py) is printed next to them. Step time: median over the timed steps.

    python bench/recompute.py [--hidden 512] [--layers 8] [--seq 512] [--batch 4] [--steps 6] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from finetune_memory import cpu  # noqa: E402

MODES = {
    "none": [],
    "full": ["--recompute_config.recompute", "true"],
    "selective": ["--recompute_config.select_recompute", "true"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per mode (after one warm-up step)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args()

    from meshformer.config.load import load_config
    from meshformer.parallel import init_parallel
    from meshformer.parallel.dims import ParallelDims
    from meshformer.planner.memory import plan_memory
    from meshformer.train.hooks import StepContext
    from meshformer.train.memory import ActivationCounter
    from meshformer.train.optim import Optimizers
    from meshformer.train.step import build_parts, train_step

    base = {
        "model.model_config.hidden_size": args.hidden,
        "model.model_config.num_layers": args.layers,
        "model.model_config.num_heads": max(1, args.hidden // 64),
        "model.model_config.n_kv_heads": max(1, args.hidden // 128),
        "model.model_config.intermediate_size": args.hidden * 11 // 4,
        "model.model_config.vocab_size": 4096,
        "model.model_config.seq_length": args.seq,
        "model.model_config.compute_dtype": args.dtype,
    }
    flat = [x for k, v in base.items() for x in (f"--{k}", str(v))]
    runs = {}
    for mode, extra in MODES.items():
        cfg = load_config(None, flat + extra)
        env = init_parallel(cfg, 1)
        built = build_parts(cfg, env)
        runs[mode] = (cfg, env, built, Optimizers(built.parts.parts, cfg), [], [0])
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(4096, (args.steps + 1, args.batch, args.seq + 1), generator=g)
    for step in range(args.steps + 1):
        for mode, (cfg, env, built, opt, times, peak) in runs.items():
            counter = ActivationCounter({p.untyped_storage().data_ptr() for p in built.parts.parameters()})
            t0 = time.perf_counter()
            train_step(
                built.parts,
                opt,
                env,
                tokens[step, :, :-1],
                tokens[step, :, 1:],
                n_micro=1,
                ignore_index=-100,
                max_grad_norm=1.0,
                hooks=[StepContext(counter.hooks())] if step == 0 else [],
            )
            if step:
                times.append(time.perf_counter() - t0)
            else:
                peak[0] = counter.peak
    print(
        f"CPU: {cpu()}; torch {torch.__version__}; hidden {args.hidden}, {args.layers} layers, seq {args.seq}, "
        f"micro batch {args.batch}, {args.dtype}, {args.steps} timed steps per mode"
    )
    print("| recompute | activations (measured) | planner | vs none | step time (median) | vs none |")
    print("|---|---|---|---|---|---|")
    ref_mem, ref_t = runs["none"][5][0], statistics.median(runs["none"][4])
    for mode, (cfg, env, built, opt, times, peak) in runs.items():
        predicted = plan_memory(cfg, ParallelDims.from_config(cfg, 1), args.batch, 1)[0].activations_bytes
        t = statistics.median(times)
        print(
            f"| {mode} | {peak[0] / 2**20:,.1f} MiB | {predicted / 2**20:,.1f} MiB | {peak[0] / ref_mem - 1:+.0%} | "
            f"{t:.3f} s | {t / ref_t - 1:+.0%} |"
        )


if __name__ == "__main__":
    main()
