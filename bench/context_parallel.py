#!/usr/bin/env python
"""Activation memory per rank under context parallelism, measured and predicted, as a markdown table.

For each cp degree it launches itself under torchrun (cp processes, gloo): the trainer's step (train/step.py) on
random tokens of a small Llama (hidden 64, 2 layers, 4 heads, 2 kv heads, vocab 512, fp32) at --seq tokens a row,
and train/memory.py's meter records the saved activations of the second step on every rank; the table puts
`meshformer plan`'s prediction (planner/memory.py at the local length plus planner/context_parallel.py) beside them.

    python bench/context_parallel.py --seq 1024 --cp 1 2 4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = {
    "model.model_config.hidden_size": 64, "model.model_config.num_layers": 2, "model.model_config.num_heads": 4,
    "model.model_config.n_kv_heads": 2, "model.model_config.intermediate_size": 128,
    "model.model_config.vocab_size": 512, "seed": 3,
}  # fmt: skip
BATCH = 2


def config(seq: int, cp: int):
    from meshformer.config.load import load_config

    args = []
    for k, v in {**MODEL, "model.model_config.seq_length": seq, "parallel_config.context_parallel": cp}.items():
        args += [f"--{k}", str(v)]
    return load_config(None, args)


def worker(seq: int, cp: int, out: Path) -> None:
    """Under torchrun: two steps, then this rank's measured activations (the metrics rank writes them)."""
    import torch

    from meshformer.parallel import init_parallel
    from meshformer.train.memory import MemoryMeter
    from meshformer.train.optim import Optimizers
    from meshformer.train.step import build_parts, train_step

    cfg = config(seq, cp)
    env = init_parallel(cfg)
    parts = build_parts(cfg, env).parts
    opt = Optimizers(parts.parts, cfg)
    meter = MemoryMeter(env, parts, opt)
    tokens = torch.randint(512, (2, BATCH, seq + 1), generator=torch.Generator().manual_seed(0))
    record = {}
    for step in range(2):
        x, y = tokens[step, :, :-1], tokens[step, :, 1:]
        train_step(parts, opt, env, x, y, n_micro=1, ignore_index=-100, max_grad_norm=1.0, hooks=[meter], step=step + 1)
        record = meter.record()
    if env.is_metrics_rank:
        out.write_text(json.dumps(record))
    env.shutdown()


def predicted(seq: int, cp: int) -> int:
    from meshformer.parallel.dims import ParallelDims
    from meshformer.planner.context_parallel import local_config, with_context_parallel
    from meshformer.planner.memory import plan_memory

    cfg = config(seq, cp)
    dims = ParallelDims.from_config(cfg, cp)
    stage = plan_memory(local_config(cfg), dims, BATCH, 1)[0]
    return with_context_parallel(stage, cfg, dims, BATCH).activations_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.seq, args.cp[0], Path(args.out))
    print(f"seq {args.seq}, batch {BATCH}, fp32; activation bytes per rank (MB)\n")
    print("| cp | measured | planned | planned / measured | measured / cp1 |")
    print("|---|---|---|---|---|")
    base = None
    for cp in args.cp:
        out = Path(tempfile.mkdtemp()) / "mem.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(cp), __file__]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
        cmd += ["--worker", "--seq", str(args.seq), "--cp", str(cp), "--out", str(out)]
        subprocess.run(cmd, check=True, env=env, capture_output=True)
        got = json.loads(out.read_text())["mem_activations_bytes"]
        plan = predicted(args.seq, cp)
        base = base or got
        print(f"| {cp} | {got / 1e6:.2f} | {plan / 1e6:.2f} | {plan / got:.3f} | {got / base:.2f} |")


if __name__ == "__main__":
    main()
