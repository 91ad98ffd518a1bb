"""Expert-parallel checks beyond the parity cases (tests/parity/test_expert_parallel.py), on the harness's MoE model.

usage: torchrun --nproc-per-node N tests/dist/ep_worker.py OUT DIR JOB:CASE ...   (or `run` in one process)
- `save:CASE` trains SAVED_AT steps under CASE, saves weights, routing biases and optimizer states through the
  trainer's CheckpointSaver into DIR/ckpt, then trains on to the end;
- `load:CASE` builds a fresh model under CASE, loads that checkpoint as a resumed run does (Checkpointing.load:
  DCP reshards to this layout) and trains the remaining steps;
- `grads:CASE` trains one step and keeps every routed-expert gradient as the optimizer sees it (whole tensors);
- `parity:CASE:VARIANT` is parity_worker.py's case (the same keys in OUT): the parity cases of a world size and
  these jobs share one launch, one set of process start-ups.
The metrics rank of each job writes {"JOB:CASE": [[loss, grad_norm, *aux], ...]} into OUT (json), the save job
also this rank's local expert shape; a grads job's tensors go to DIR/grads_CASE.safetensors.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from safetensors.torch import save_file  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import harness  # noqa: E402
from meshformer.checkpoint.saver import CheckpointSaver  # noqa: E402
from meshformer.models.init import canonical_name  # noqa: E402
from meshformer.parallel import init_parallel  # noqa: E402
from meshformer.train.checkpointing import Checkpointing  # noqa: E402
from meshformer.train.optim import Optimizers  # noqa: E402
from meshformer.train.step import build_parts  # noqa: E402

SAVED_AT = 2
VARIANT = "moe_bal"  # balancing on: the routing biases travel in the checkpoint and steer the resumed routes


class ExpertGrads:
    """Every routed-expert gradient, whole, right before the optimizer step (after clipping)."""

    def __init__(self, parts):
        self.parts, self.grads = parts, {}

    def before_optimizer_step(self, step) -> None:
        for part in self.parts.parts:
            for name, p in part.named_parameters():
                if ".mlp.experts." in name and p.grad is not None:
                    g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad  # a collective over its mesh
                    self.grads[canonical_name(name)] = g.detach().clone()


def run(job: str, case: str, where: Path, world_size: int | None = None) -> tuple[dict, dict, object]:
    """(this rank's results, its expert gradients (grads jobs), env)."""
    overrides, n_micro = harness.spec_of(case) if case != "single" else ({}, 1)
    cfg = harness.make_cfg({**harness.VARIANTS[VARIANT], **overrides})
    env = init_parallel(cfg, world_size)
    built = build_parts(cfg, env)
    parts, opt = built.parts, Optimizers(built.parts.parts, cfg)
    key, result, grads = f"{job}:{case}", {}, {}
    ckpt = where / "ckpt"
    if job == "grads":
        probe = ExpertGrads(parts)
        result[key] = harness.train_steps(parts, opt, cfg, env, n_micro, range(1), hooks=[probe])
        return result, probe.grads, env
    if job == "save":
        harness.train_steps(parts, opt, cfg, env, n_micro, range(SAVED_AT))
        CheckpointSaver(env.rank, env.all_ok, env.barrier).save(ckpt, parts.parts, opt.items, {}, {})
        w = parts.parts[0].get_submodule("layers.0.mlp.experts").gate_proj
        result[f"{key}:local_experts"] = list((w.to_local() if isinstance(w, DTensor) else w).shape)
    else:
        shapes = {k: tuple(v.shape) for p in parts.parts for k, v in p.state_dict().items()}
        Checkpointing.load(ckpt, parts.parts, opt.items, shapes if env.pp_size == 1 else None)
    result[key] = harness.train_steps(parts, opt, cfg, env, n_micro, range(SAVED_AT, harness.STEPS))
    result[f"{key}:biases"] = harness.router_biases(parts)
    return result, grads, env


def main() -> None:
    out_path, where, jobs = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    results, env = {}, None
    for spec in jobs:
        job, _, case = spec.partition(":")
        if job == "parity":
            case, _, variant = case.partition(":")
            res, env, memory = harness.run_case(case, variant)
            results[f"{case}:{variant}:memory:{env.rank}"] = memory
            if env.is_metrics_rank:
                results[f"{case}:{variant}"] = res
            continue
        res, grads, env = run(job, case, where)
        if env.is_metrics_rank:
            results.update(res)
        if job == "grads":  # pipeline stages hold different layers: rank 0 writes them all
            merged = {k: v for g in env.all_gather_object(grads) for k, v in g.items()}
            if env.rank == 0:
                save_file({k: v.contiguous() for k, v in merged.items()}, str(where / f"grads_{case}.safetensors"))
    gathered = env.all_gather_object(results)
    if env.rank == 0:
        out_path.write_text(json.dumps({k: v for r in gathered for k, v in r.items()}))
    env.shutdown()


if __name__ == "__main__":
    main()
