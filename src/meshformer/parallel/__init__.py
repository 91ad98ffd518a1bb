"""Parallelism applied from outside the model, one function per technique, composed in `parallelize`.

Order (see docs/design.md): tensor parallel -> activation recompute -> data parallel / FSDP, each applied to
the pipeline stage(s) this rank holds after `split_pipeline`.
"""

from __future__ import annotations

from meshformer.parallel.env import ParallelEnv, init_parallel
from meshformer.parallel.parts import ModelParts, parallelize

__all__ = ["ParallelEnv", "init_parallel", "ModelParts", "parallelize"]
