#!/usr/bin/env python
"""The planner's memory per rank against what the parity suite's runs measured, as a markdown table.

Launches tests/dist/parity_worker.py (the parallelism suite's tiny model: 4 layers, hidden 64, GQA, q/k/v bias,
q/k norm, fp32, 16 x 16 tokens per step) for the given cases on N processes; every rank records its memory after
its first step (train/memory.py); the table puts planner/memory.py's prediction next to it.

    python bench/planner_vs_measured.py --nproc 2 dp2 tp2_sp_accum fsdp2 pp2_1f1b [--results r.json]
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
sys.path.insert(0, str(ROOT / "tests" / "dist"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, required=True)
    ap.add_argument("--results", default=None, help="a parity_worker output to read instead of launching")
    ap.add_argument("cases", nargs="+", help="CASE[:VARIANT] of tests/dist/harness.py")
    args = ap.parse_args()
    import harness
    from meshformer.parallel.dims import ParallelDims
    from meshformer.planner.memory import plan_memory

    if args.results:
        results = json.loads(Path(args.results).read_text())
    else:
        out = Path(tempfile.mkdtemp()) / "r.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        subprocess.run(
            [*cmd, str(ROOT / "tests/dist/parity_worker.py"), str(out), *args.cases],
            check=True,
            env=env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
        )
        results = json.loads(out.read_text())
    print("| layout | rank (stage) | params | grads | optimizer | activations measured | predicted | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for spec in args.cases:
        case, _, variant = spec.partition(":")
        variant = variant or "fp32"
        overrides, n_micro = harness.spec_of(case)
        cfg = harness.make_cfg({**harness.VARIANTS[variant], **overrides})
        dims = ParallelDims.from_config(cfg, args.nproc)
        stages = plan_memory(cfg, dims, harness.GLOBAL_BATCH // dims.dp // n_micro, n_micro)
        for rank in range(args.nproc):
            m = results.get(f"{case}:{variant}:memory:{rank}")
            if m is None:
                continue
            p = stages[m["stage"]]

            def cell(got: int, want: int) -> str:
                return f"{got:,}" if got == want else f"{got:,} / {want:,}"

            a, b = m["mem_activations_bytes"], p.activations_bytes
            print(
                f"| {spec} | {rank} ({m['stage']}) | {cell(m['mem_params_bytes'], p.params_bytes)} | "
                f"{cell(m['mem_grads_bytes'], p.grads_bytes)} | {cell(m['mem_optim_bytes'], p.optimizer_bytes)} | "
                f"{a:,} | {b:,} | {b / max(a, 1):.3f} |"
            )


if __name__ == "__main__":
    main()
