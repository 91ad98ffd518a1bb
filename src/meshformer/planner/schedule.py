"""Which micro-batches a pipeline rank holds activations for, step by step, from the schedule's own action list.

torch's multi-stage schedules (interleaved 1F1B, looped BFS, the zero-bubble ones, DualPipeV) compute each rank's
order of actions (`pipeline_order`) when they are built; building one needs only a few attributes of its stages,
so the planner builds it on stand-ins and replays it: a forward (F) makes a micro-batch's activations of that
stage live; a full backward (B) frees them; a split backward keeps them through the input half (I: torch keeps
the graph for the weight half) and frees them at the weight half (W).
"""

from __future__ import annotations

import types
from functools import lru_cache

import torch


@lru_cache(maxsize=64)
def rank_actions(schedule: str, pp: int, stages_per_rank: int, n_micro: int, rank: int, stage_ids: tuple[int, ...]):
    """[(kind, stage, micro-batch)] of one pipeline rank, kind in F, B, I, W; None for single-stage schedules."""
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    from meshformer.backends.torch_private import pipeline_computation_type
    from meshformer.parallel.pipeline import SCHEDULES

    computation_type = pipeline_computation_type()

    cls = SCHEDULES[schedule]
    if not issubclass(cls, PipelineScheduleMulti):
        return None
    n_stages = pp * stages_per_rank
    stand_ins = [
        types.SimpleNamespace(
            stage_index=s,
            num_stages=n_stages,
            group_size=pp,
            group_rank=rank,
            is_first=s == 0,
            is_last=s == n_stages - 1,
            has_backward=True,
            stage_index_to_group_rank=None,
            submod=torch.nn.Identity(),
        )
        for s in stage_ids
    ]
    order = cls(stand_ins, n_microbatches=n_micro, loss_fn=lambda *a: None).pipeline_order[rank]
    out = []
    for action in order:
        if action is None:
            continue
        for a in action.sub_actions or (action,):
            kind = computation_type(a.computation_type).value
            if kind in ("F", "B", "I", "W"):
                out.append((kind, a.stage_index, a.microbatch_index))
    return out


def peak_live(actions, per_stage: dict[int, int], after_w: dict[int, int] | None = None) -> tuple[int, int]:
    """(peak bytes, micro-batches live at that peak) replaying `actions` with each stage's bytes per micro-batch;
    `after_w`: what a micro-batch of a stage still holds from its W until the step ends (split backward: torch's
    weight pass frees only part of the graph: the family says how much, models/llama/activations.py for Llama)."""
    after_w = after_w or {}
    live = {s: 0 for s in per_stage}
    lingering = {s: 0 for s in per_stage}
    peak = count = 0
    for kind, stage, _ in actions:
        if kind == "F":
            live[stage] += 1
        elif kind in ("B", "W"):
            live[stage] -= 1
            lingering[stage] += kind == "W"
        total = sum(live[s] * per_stage[s] + lingering[s] * after_w.get(s, 0) for s in live)
        if total > peak:
            peak, count = total, sum(live.values())
    return peak, count
