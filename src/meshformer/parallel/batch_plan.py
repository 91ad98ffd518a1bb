"""How many samples one optimizer step takes, and how they are split: micro-batches, accumulation, data parallel."""

from __future__ import annotations

from dataclasses import dataclass

from meshformer.config.schema import MeshformerConfig
from meshformer.parallel.dims import ParallelDims


@dataclass
class BatchPlan:
    micro_batch: int  # samples per forward pass
    n_micro: int  # forward passes per optimizer step on each rank (accumulation x pipeline micro-batches)
    global_batch: int  # samples per optimizer step, all ranks together

    @classmethod
    def from_config(cls, cfg: MeshformerConfig, dims: ParallelDims) -> "BatchPlan":
        pc = cfg.parallel_config
        mb = cfg.train_dataset.batch_size or cfg.runner_config.batch_size or 1
        n_micro = cfg.runner_config.gradient_accumulation_steps * (pc.micro_batch_num if pc.pipeline_stage > 1 else 1)
        return cls(mb, n_micro, mb * n_micro * dims.dp)

    def describe(self, cfg: MeshformerConfig, dims: ParallelDims) -> str:
        pc = cfg.parallel_config
        pp = f" x micro_batch_num {pc.micro_batch_num}" if pc.pipeline_stage > 1 else ""
        return (
            f"global batch {self.global_batch} = micro batch {self.micro_batch} x data_parallel {dims.dp} "
            f"x gradient_accumulation {cfg.runner_config.gradient_accumulation_steps}{pp}"
        )
