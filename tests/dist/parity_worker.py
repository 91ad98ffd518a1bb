"""Under torchrun: run several parity cases (one layout after another on one process group), write results.

usage: torchrun --nproc-per-node N tests/dist/parity_worker.py OUT.json CASE[:VARIANT] ...
The metrics rank of each case writes {"CASE:VARIANT": [[loss, grad_norm], ...]} into OUT.json, and every rank
its memory breakdown after the second step as {"CASE:VARIANT:memory:RANK": {...}} (train/memory.py's fields).
"""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402

from harness import run_case  # noqa: E402


def main() -> None:
    out_path, specs = Path(sys.argv[1]), sys.argv[2:]
    results, env = {}, None
    for spec in specs:
        case, _, variant = spec.partition(":")
        # Every case compiles as a fresh run would: dynamo's per-function recompile limit counts the graphs of all
        # the cases a process ran (past it a later compiled case runs its layers eager), and a size that differs
        # from an earlier case's makes dynamo recompile with dynamic shapes.
        torch.compiler.reset()
        t = time.time()
        res, env, memory = run_case(case, variant or "fp32")
        results[f"{case}:{variant or 'fp32'}:memory:{env.rank}"] = memory
        if env.is_metrics_rank:
            results[f"{case}:{variant or 'fp32'}"] = res
            print(f"[parity] {spec}: {time.time() - t:.1f}s {res[-1]}", flush=True)
    # Each case has one metrics rank and it may differ between cases: gather everyone's findings on rank 0.
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        merged = {k: v for r in gathered for k, v in r.items()}
        out_path.write_text(json.dumps(merged))
    env.shutdown()


if __name__ == "__main__":
    main()
