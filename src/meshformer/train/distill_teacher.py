"""The distillation teacher (`distill_config.teacher`): a frozen model of its own family, built and parallelized
exactly as the student is, whose logits the step hands to the distillation loss (train/distill_step.py).

Its model: the teacher's own `model_config` (a meshformer checkpoint's config.yaml, or a Hugging Face directory's
config.json through the model sources the caller hands in, as `load_checkpoint` is read: train/finetune.py), with
the run's numerics and sequence length, no LoRA and no freezing (it is frozen whole). It goes through the same
`build_parts` as the student, on the same mesh (data, FSDP, tensor and pipeline parallelism), so its logits for a
micro-batch sit on the ranks, and in the vocabulary shards, where the student's do: the loss combines them without
moving anything. Its layout must fit its own shape (tensor parallelism divides its heads, pipeline stages at most
its layers): a mismatch is one line naming the teacher.

It is a FrozenModel (train/frozen_model.py), as a preference run's reference is: its forward runs under
`torch.no_grad()` in eval mode (no activations kept, no gradients, no optimizer state). Without pipeline
parallelism it runs inside the student's loss, one micro-batch at a time (`micro_batch_logits`), so only one
micro-batch's teacher logits ever exist, and its FSDP-gathered weights are freed once, after the step's last
micro-batch; with it, its stages are walked forward-only for all the step's micro-batches before the student's
schedule runs (`map_logits`, parallel/pipeline_forward.py), and their logits wait on the last stage, where the
student's loss runs.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path

from meshformer.checkpoint import store
from meshformer.config.schema import MeshformerConfig
from meshformer.config.validate import validate_layout
from meshformer.errors import UserError
from meshformer.models.init import canonical_name
from meshformer.parallel import ParallelEnv
from meshformer.train.base_source import BaseModelSource, source_of
from meshformer.train.finetune import base_model_config
from meshformer.train.frozen_model import FrozenModel
from meshformer.train.step import build_parts

FIELD = "distill_config.teacher"
# What belongs to the run, not to the teacher's checkpoint: the numerics and the sequence length the step runs at
RUN_FIELDS = (
    "seq_length",
    "param_init_type",
    "compute_dtype",
    "softmax_compute_dtype",
    "layernorm_compute_dtype",
    "rotary_dtype",
    "ignore_token_id",
)


def teacher_config(cfg: MeshformerConfig, sources: Sequence[BaseModelSource] = ()) -> MeshformerConfig:
    """The run's config with the teacher's model in place of the student's (its own family and shape, the run's
    RUN_FIELDS, no LoRA, an even pipeline split), its layout checked against the teacher's shape."""
    student = cfg.model.model_config
    teacher = base_model_config(cfg.distill_config.teacher, sources)
    for name in RUN_FIELDS:
        setattr(teacher, name, getattr(student, name))
    teacher.pet_config = type(student.pet_config)()
    out = copy.copy(cfg)
    out.model = copy.copy(cfg.model)
    out.model.model_config = teacher
    out.distill_config = type(cfg.distill_config)()  # the teacher itself is trained by nothing
    try:
        teacher.validate(out)
        validate_layout(out, world_size=None)
    except UserError as e:
        raise UserError(f"{FIELD}={cfg.distill_config.teacher!r} does not fit the run's layout: {e}") from None
    return out


def build_teacher(cfg: MeshformerConfig, env: ParallelEnv, sources: Sequence[BaseModelSource] = ()) -> FrozenModel:
    """The teacher `distill_config.teacher` names, built as the student is, loaded with its weights, frozen."""
    tcfg = teacher_config(cfg, sources)
    built = build_parts(tcfg, env, transforms=())
    # by their checkpoint names: a compiled or recomputed layer's wrappers are not part of them
    expected = {canonical_name(k): tuple(v.shape) for k, v in built.model.state_dict().items()}
    path = Path(cfg.distill_config.teacher)
    source = source_of(path, sources)
    if source is not None:
        store.load_full_weights(built.parts.parts, source.weights(path, expected, FIELD))
    else:
        store.load_model_weights(store.resolve_checkpoint(path), built.parts.parts, expected)
    return FrozenModel.frozen(built.parts)
