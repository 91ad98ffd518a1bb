"""Context-parallel checks on the parity harness's model (tests/parity/test_context_parallel.py).

usage: torchrun --nproc-per-node N tests/dist/cp_worker.py OUT DIR JOB:CASE[:VARIANT] ...
- `parity:CASE[:VARIANT]` trains the harness's steps under CASE (then evaluates once), as parity_worker does, and
  records the metrics rank's memory of the second step (train/memory.py) as `memory:CASE:VARIANT`;
- `save:CASE` trains SAVED_AT steps under CASE, saves weights and optimizer states through the trainer's
  CheckpointSaver into DIR/ckpt, then trains on to the end (the uninterrupted run); `resume` (one process, in the
  test) loads that checkpoint as a resumed run does (DCP reshards) and trains the remaining steps.
The metrics rank of each job writes {"JOB:CASE[:VARIANT]": [[loss, grad_norm], ...]} into OUT (json).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from meshformer.checkpoint.saver import CheckpointSaver  # noqa: E402
from meshformer.parallel import init_parallel  # noqa: E402
from meshformer.train.checkpointing import Checkpointing  # noqa: E402
from meshformer.train.optim import Optimizers  # noqa: E402
from meshformer.train.step import build_parts  # noqa: E402

SAVED_AT = 2
P = harness.P
# name -> (overrides, micro-batches per step on each rank); world size = dp x tp x cp.
CASES = {
    "cp2": ({P + "context_parallel": 2}, 1),
    "cp2_rc_accum": ({P + "context_parallel": 2, "recompute_config.recompute": True}, 2),
    "cp4": ({P + "context_parallel": 4}, 1),
    "cp2_ep2": ({P + "context_parallel": 2, P + "expert_parallel": 2}, 1),
    "dp2xcp2_accum": ({P + "data_parallel": 2, P + "context_parallel": 2}, 2),  # HSDP: replicas x cp shards
    "fsdp2xcp2": ({P + "data_parallel": 2, P + "optimizer_shard": True, P + "context_parallel": 2}, 1),
    "tp2xcp2": ({P + "model_parallel": 2, P + "context_parallel": 2}, 1),
    "pp2xcp2": ({P + "pipeline_stage": 2, P + "micro_batch_num": 4, P + "context_parallel": 2}, 4),
    "pp2xcp2_zbv_rc": ({P + "pipeline_stage": 2, P + "micro_batch_num": 4, P + "pipeline_schedule": "zbv_zero_bubble",
                        P + "context_parallel": 2, "recompute_config.recompute": True}, 4),
    "tp2xcp2_sp_rc": ({P + "model_parallel": 2, P + "use_seq_parallel": True, P + "context_parallel": 2,
                       "recompute_config.recompute": True}, 1),
    "fsdp2xtp2xcp2_accum": ({P + "data_parallel": 2, P + "optimizer_shard": True, P + "model_parallel": 2,
                             P + "context_parallel": 2}, 2),
}  # fmt: skip

# The MoE model with every balancing term but the sequence-wise loss (global-batch loss, z-loss, bias update).
harness.VARIANTS["moe_bal_gb"] = {
    **harness.BALANCE,
    "model.model_config.moe_config.aux_loss_types": ["global_batch"],
    "model.model_config.moe_config.aux_loss_factors": [0.01],
}


def world_of(case: str) -> int:
    o = CASES[case][0]
    return o.get(P + "data_parallel", 1) * o.get(P + "model_parallel", 1) * o.get(P + "context_parallel", 1)


def run(job: str, case: str, variant: str, where: Path, world_size: int | None = None) -> tuple[dict, object]:
    """(this rank's results, env). case "single": one process."""
    overrides, n_micro = CASES[case] if case != "single" else ({}, 1)
    cfg = harness.make_cfg({**harness.VARIANTS[variant], **overrides})
    env = init_parallel(cfg, world_size)
    packed = harness.is_packed(variant)
    key = f"{job}:{case}:{variant}"
    if job == "parity":
        out, memory = harness.run(cfg, env, n_micro, harness.VARIANT_TRANSFORMS.get(variant), packed=packed)
        return {key: out, f"memory:{case}:{variant}": {k: v for k, v in memory.items() if k.startswith("mem_")}}, env
    built = build_parts(cfg, env)
    parts, opt = built.parts, Optimizers(built.parts.parts, cfg)
    ckpt = where / "ckpt"
    if job == "save":
        harness.train_steps(parts, opt, cfg, env, n_micro, range(SAVED_AT), packed)
        CheckpointSaver(env.rank, env.all_ok, env.barrier).save(ckpt, parts.parts, opt.items, {}, {})
    elif job == "resume":
        shapes = {k: tuple(v.shape) for p in parts.parts for k, v in p.state_dict().items()}
        Checkpointing.load(ckpt, parts.parts, opt.items, shapes)
    else:
        raise ValueError(f"unknown job {job!r}")
    return {key: harness.train_steps(parts, opt, cfg, env, n_micro, range(SAVED_AT, harness.STEPS), packed)}, env


def main() -> None:
    out_path, where, jobs = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    results, env = {}, None
    for spec in jobs:
        job, case, *variant = spec.split(":")
        res, env = run(job, case, variant[0] if variant else "fp32", where)
        if env.is_metrics_rank:
            results.update(res)
    harness.write_results(env, results, out_path)


if __name__ == "__main__":
    main()
