"""`fp8_config.precompute_float8_dynamic_scale_for_fsdp`: after each optimizer step, the FP8 scales of every weight
FSDP2 gathers in FP8, all in one all-reduce (torchao's `precompute_float8_dynamic_scale_for_fsdp`), instead of one
small all-reduce per weight at its gather; torchtitan's Float8 converter runs it after the optimizer the same way.
The config allows it only with `enable_fsdp_float8_all_gather`, a GPU (NCCL) feature (parallel/float8.py).
"""

from __future__ import annotations

from meshformer.train.hooks import TrainHook, register_hook


class Float8ScalesHook(TrainHook):
    def __init__(self, parts):
        self.parts = parts

    @classmethod
    def for_run(cls, cfg, parts):
        """The hook of a run that asks for precomputed scales (None otherwise)."""
        fc = cfg.fp8_config
        return cls(parts) if fc.enable and fc.precompute_float8_dynamic_scale_for_fsdp else None

    def after_optimizer_step(self, step) -> None:
        from meshformer.parallel.float8 import torchao_float8

        precompute = torchao_float8().precompute_float8_dynamic_scale_for_fsdp
        for part in self.parts.parts:
            precompute(part)


register_hook("float8_scales", Float8ScalesHook.for_run)
