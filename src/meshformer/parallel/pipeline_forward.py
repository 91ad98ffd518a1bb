"""A forward-only pass through a frozen model's pipeline stages: a second model in the step (a distillation teacher,
a preference reference: train/frozen_model.py) whose logits the trained model's last stage needs for the same
micro-batches.

The training schedules cannot serve it: they always run backward, and a frozen model has none to run. Its stages
are walked in global order for each micro-batch, as `PipelineParts.eval_loss` walks the student's, but with plain
point-to-point sends over the pipeline group: a frozen model never ran a schedule, so its stages have no receive
buffers. Each send is preceded by a small header (rank, shape, dtype), so the receiver needs no shape inference.
Every rank walks the same global order, so the sends and receives pair up without deadlock; V schedules, whose
middle stages sit on one rank, hand the activation over in place.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshformer.parallel.parts import ModelParts
from meshformer.parallel.pipeline import stage_ids

# The dtypes an activation between stages may have (the header's code is the index)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HEADER = 6  # ndim, dtype code, up to 4 sizes


def _send(t: torch.Tensor, group, dst: int) -> None:
    if isinstance(t, DTensor):  # a stage hands its neighbour this rank's part, as PipelineStage does
        t = t.to_local()
    t = t.contiguous()
    header = torch.zeros(_HEADER, dtype=torch.int64, device=t.device)
    header[0], header[1] = t.dim(), _DTYPES.index(t.dtype)
    header[2 : 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    dist.send(header, group=group, group_dst=dst)
    dist.send(t, group=group, group_dst=dst)


def _recv(group, src: int, device: torch.device) -> torch.Tensor:
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, group=group, group_src=src)
    ndim, code = int(header[0]), int(header[1])
    t = torch.empty(header[2 : 2 + ndim].tolist(), dtype=_DTYPES[code], device=device)
    dist.recv(t, group=group, group_src=src)
    return t


@torch.no_grad()
def pipeline_forward(parts: ModelParts, inputs: torch.Tensor, n_micro: int, fn: Callable) -> list:
    """[fn(logits, i) for each of the n_micro micro-batches of `inputs`] on the pipeline rank that holds the last
    stage ([] on the others): every stage's forward, in eval mode, no gradients, with the parts' autocast and
    (tensor parallelism) vocab-sharded loss context. `parts`: a PipelineParts (stage_ids, n_stages)."""
    env, cfg = parts.env, parts.cfg
    owner = {s: r for r in range(env.pp_size) for s in stage_ids(cfg, r)}
    mine = dict(zip(parts.stage_ids, parts.parts))
    last, me, group = parts.n_stages - 1, env.pp_rank, env.group("pp")
    out = []
    with parts.loss_context(), parts.autocast():
        for i, x in enumerate(inputs.chunk(n_micro)):
            h = x
            for s in range(parts.n_stages):
                if s not in mine:
                    continue
                if s > 0 and owner[s - 1] != me:
                    h = _recv(group, owner[s - 1], env.device)
                h = mine[s](h)
                if s == last:
                    out.append(fn(h, i))
                elif owner[s + 1] != me:
                    _send(h, group, owner[s + 1])
            del h
    return out
