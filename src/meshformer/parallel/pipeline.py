"""Pipeline parallelism (`pipeline_stage`) with torch.distributed.pipelining.

The model is cut by layers (config.validate.stage_layer_counts, honouring model_config.offset) into
pipeline_stage x (virtual stages per rank) pieces. A piece is a copy of the meta-device Transformer with
the modules it does not hold deleted: layer keys stay global, so parameter names (and checkpoints) are the
same under every layout. Stage s of S: first stage keeps embed_tokens, last keeps norm and lm_head.

Stage placement: single-stage schedules put stage r on pp rank r; looped schedules (interleaved_1f1b,
looped_bfs, interleaved_zero_bubble) put stages r, r+p, r+2p, ...; V schedules (zbv_zero_bubble, dualpipev)
put stages r and 2p-1-r, so the first and last stage share rank 0.
"""

from __future__ import annotations

import copy

from torch import nn
from torch.distributed.pipelining import schedules as S

from meshformer.config.schema import MeshformerConfig
from meshformer.config.validate import V_SCHEDULES, stage_layer_counts, stages_per_rank

SCHEDULES = {
    "gpipe": S.ScheduleGPipe,
    "1f1b": S.Schedule1F1B,
    "interleaved_1f1b": S.ScheduleInterleaved1F1B,
    "looped_bfs": S.ScheduleLoopedBFS,
    "interleaved_zero_bubble": S.ScheduleInterleavedZeroBubble,
    "zbv_zero_bubble": S.ScheduleZBVZeroBubble,
    "dualpipev": S.ScheduleDualPipeV,
}


def stage_ids(cfg: MeshformerConfig, pp_rank: int) -> list[int]:
    """Global stage indices held by pipeline rank `pp_rank`, in execution order."""
    pp = cfg.parallel_config.pipeline_stage
    v = stages_per_rank(cfg)
    if cfg.parallel_config.pipeline_schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(v)]


def stage_layers(cfg: MeshformerConfig) -> list[range]:
    """Global layer indices of every stage."""
    ranges, start = [], 0
    for n in stage_layer_counts(cfg):
        ranges.append(range(start, start + n))
        start += n
    return ranges


def split_pipeline(model: nn.Module, cfg: MeshformerConfig, pp_rank: int) -> list[tuple[int, nn.Module]]:
    """(stage index, module) for each stage this rank holds; `model` is on the meta device and not modified."""
    layers = stage_layers(cfg)
    n_stages = len(layers)
    out = []
    for s in stage_ids(cfg, pp_rank):
        part = copy.deepcopy(model)  # meta tensors: copying costs no memory
        for key in list(part.layers.keys()):
            if int(key) not in layers[s]:
                del part.layers[key]
        if s != 0:
            part.embed_tokens = None
        if s != n_stages - 1:
            part.norm = None
            part.lm_head = None
        out.append((s, part))
    return out


def num_stages(cfg: MeshformerConfig) -> int:
    return cfg.parallel_config.pipeline_stage * stages_per_rank(cfg)
