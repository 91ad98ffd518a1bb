"""`meshformer plan --search`: every valid layout for the device count and the config's global batch, planned; those
that fit, ranked by predicted throughput.

Enumerated: data x tensor x pipeline degrees whose product is the device count (tensor parallel dividing the heads,
KV heads and FFN width, and no wider than a node: its collectives run every layer), optimizer sharding on or off, no /
selective / full recompute, the micro batch, and how the rest of the global batch is split between pipeline
micro-batches (micro_batch_num, at least the stage count) and gradient accumulation.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from meshformer.planner.plan import Plan, make_plan

RECOMPUTE = {"none": (False, False), "selective": (False, True), "full": (True, False)}


@dataclass
class Candidate:
    plan: Plan
    layout: dict  # the config fields that make it

    def describe(self) -> str:
        lay = self.layout
        parts = [f"dp{lay['data_parallel']}", f"tp{lay['model_parallel']}", f"pp{lay['pipeline_stage']}"]
        if lay["optimizer_shard"]:
            parts.append("zero")
        return "x".join(parts[:3]) + ("+" + parts[3] if len(parts) > 3 else "")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(base: Plan) -> list[Candidate]:
    from meshformer.errors import UserError
    from meshformer.parallel.dims import ParallelDims

    cfg0, world = base.cfg, base.dims.world_size
    mc = cfg0.model.model_config
    per_node = max(1, world // max(1, base.nodes))
    global_batch = base.micro_batch * base.n_micro * base.dims.dp
    out = []
    for tp in _divisors(world):
        if tp > per_node or mc.num_heads % tp or mc.num_kv_heads % tp or mc.ffn_hidden_size % tp:
            continue
        for pp in _divisors(world // tp):
            dp = world // (tp * pp)
            if pp > mc.num_layers or global_batch % dp:
                continue
            per_dp = global_batch // dp
            for mb in [m for m in (1, 2, 4, 8, 16) if per_dp % m == 0]:
                n_micro = per_dp // mb
                splits = [(1, n_micro)] if pp == 1 else [(k, n_micro // k) for k in _divisors(n_micro) if k >= pp]
                for mbn, accum in splits[:3]:
                    for shard in (False, True) if dp > 1 else (False,):
                        for rc_name, (full, sel) in RECOMPUTE.items():
                            layout = {
                                "data_parallel": dp,
                                "model_parallel": tp,
                                "pipeline_stage": pp,
                                "micro_batch_num": mbn,
                                "optimizer_shard": shard,
                                "micro_batch": mb,
                                "gradient_accumulation_steps": accum,
                                "recompute": rc_name,
                            }
                            cfg = copy.deepcopy(cfg0)
                            pc = cfg.parallel_config
                            pc.data_parallel, pc.model_parallel, pc.pipeline_stage = dp, tp, pp
                            pc.micro_batch_num, pc.optimizer_shard = mbn, shard
                            cfg.optimizer.optimizer_parallel = 0
                            cfg.parallel.enable_parallel_optimizer = False
                            cfg.train_dataset.batch_size = mb
                            cfg.runner_config.gradient_accumulation_steps = accum
                            cfg.recompute_config.recompute, cfg.recompute_config.select_recompute = full, sel
                            try:
                                dims = ParallelDims.from_config(cfg, world)
                            except UserError:
                                continue
                            n = accum * (mbn if pp > 1 else 1)
                            plan = make_plan(cfg, dims, base.accelerator, mb, n, base.nodes, base.device_memory)
                            out.append(Candidate(plan, layout))
    return out


def search(base: Plan, top: int = 10) -> tuple[list[Candidate], int]:
    """(the fitting layouts, fastest first, at most `top`; how many were planned)."""
    every = candidates(base)

    def rank(c: Candidate) -> tuple:  # fastest first; of equals, the one with the most headroom
        return (-round(c.plan.throughput.tokens_per_s), max(s.reserved_bytes for s in c.plan.stages))

    fitting = sorted((c for c in every if c.plan.fits), key=rank)
    return fitting[:top], len(every)
