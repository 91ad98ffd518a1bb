"""Parallelism applied from outside the model, one function per technique, composed in `parallelize`.

Order (see docs/design.md and parallelize.py): tensor parallel -> activation recompute -> data parallel / FSDP,
each applied to the pipeline stage(s) this rank holds after `split_pipeline`. `dims.py` is the layout as plain
numbers, `env.py` the process group and DeviceMesh built from it.
"""

from __future__ import annotations

from meshformer.parallel.env import ParallelEnv, init_parallel
from meshformer.parallel.parallelize import parallelize
from meshformer.parallel.parts import ModelParts

__all__ = ["ParallelEnv", "init_parallel", "ModelParts", "parallelize"]
