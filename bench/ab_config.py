#!/usr/bin/env python
"""Step time of meshformer config variants on bench_vs_hf's model, alternating step by step in one process.

Separate runs on a shared or virtual machine drift by 10% or more from one minute to the next; steps that take
turns in one process see the same drift, so the ratio of their medians is what one variant changes. Each variant
is a space-separated list of config overrides (`KEY=VALUE`, as bench_vs_hf's `--mf`); the model, batch, seed and
token batches are bench_vs_hf's, and each variant is built, warmed up (compiled, where it compiles) and then timed.

    python bench/ab_config.py --dtype bf16 --steps 12 -- "" "model.model_config.param_init_type=bfloat16"
    python bench/ab_config.py --steps 10 -- "compile=true" "compile=false"

Arguments before `--` are bench_vs_hf's (model shape, batch, dtype, --steps timed steps per variant, --warmup).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_vs_hf as bench  # noqa: E402


def main(argv: list[str]) -> None:
    if "--" not in argv:
        sys.exit('usage: ab_config.py [bench_vs_hf arguments] -- "VARIANT A overrides" "VARIANT B overrides" ...')
    cut = argv.index("--")
    a, variants = bench.parse_args(argv[:cut]), argv[cut + 1 :]
    data = bench.batches(a, a.warmup + a.steps)
    models = {}
    for v in variants:
        a.mf = v.split()
        torch.manual_seed(a.seed)
        models[v] = bench.build_meshformer(a)[:4]
        for tokens in data[: a.warmup]:
            bench.meshformer_step(*models[v], tokens)
    times = {v: [] for v in variants}
    losses = {v: [] for v in variants}
    for tokens in data[a.warmup :]:
        for v in variants:
            t0 = time.perf_counter()
            losses[v].append(bench.meshformer_step(*models[v], tokens))
            times[v].append(time.perf_counter() - t0)
    base = statistics.median(times[variants[0]])
    print(f"{a.steps} timed steps per variant after {a.warmup} warm-up, alternating; {a.dtype}")
    for v in variants:
        med = statistics.median(times[v])
        print(
            f"  {v or '(defaults)'!s:50s} median {med:.4f} s ({med / base - 1:+.1%}), min {min(times[v]):.4f} s, "
            f"last loss {losses[v][-1]:.6f}"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
