"""A second model in the step that never trains: a preference run's reference, a distillation run's teacher.

It is built by the same `build_parts` as the policy, so it is parallelized exactly as the policy is (the same
layout, TP plan, FSDP sharding, context parallelism): its logits for a micro-batch sit on the same ranks, in the
same shards, as the policy's, and a loss can combine the two without moving anything. It runs forward only,
under `torch.no_grad()` and in eval mode: no activations are kept, no gradients, no optimizer state.

Where it comes from:
  - `frozen(parts)`: a model of its own, frozen: `reference: copy` (its weights are the run's starting weights,
    `copy_weights_from` the policy before the first step, or loaded as the policy's were when a run resumes) and
    the distillation teacher (its own family and weights: train/distill_teacher.py build_teacher);
  - `adapters_off(parts)`: the policy's own parts with every LoRA adapter off (`reference: adapter`): the base the
    adapters started from, at no cost in memory;
  - `starting_weights(parts, lora)`: the policy itself before its first step (`reference: precomputed`'s one pass,
    train/precomputed_reference.py).
How it runs, two ways:
  - `map_logits`: all the step's micro-batches before the policy's forward (a reference; a teacher under pipeline
    parallelism). It hands each micro-batch's logits to a function and returns what it returned (a reference's
    per-sequence log-probabilities; a teacher's logits). Under pipeline parallelism its stages are walked
    forward-only (parallel/pipeline_forward.py): the function runs on the last stage, the only place where the
    policy's loss reads what it returned;
  - `micro_batch_logits`: one micro-batch at a time, inside the policy's loss (a teacher without pipeline
    parallelism), so that only one micro-batch's logits ever exist; `expect_micro_batches` tells it how many the
    step will ask for.
A model of its own frees its FSDP-gathered weights once its part of the step is over (`ModelParts.reshard`):
FSDP frees the root, and below ZeRO-3 the layers, in backward, which a frozen model never runs, so kept gathered
they would cost a whole model beside its shards. Freed after every micro-batch instead, the root (embedding,
head) would be all-gathered again for each of them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from meshformer.models.lora import adapters_off
from meshformer.parallel import ModelParts
from meshformer.parallel.pipeline_forward import pipeline_forward


class FrozenModel:
    def __init__(self, parts: ModelParts, context: Callable[[], contextlib.AbstractContextManager] | None = None):
        """parts: the model's pieces on this rank; context: what its forward runs in (adapters off)."""
        self.parts = parts
        self.context = context or contextlib.nullcontext
        self.owns_weights = context is None
        self.measure = contextlib.nullcontext  # what the memory meter watches the forward with (train/memory.py)
        self.micro_batches_left = 0  # micro_batch_logits calls before the step's last (expect_micro_batches)

    @classmethod
    def frozen(cls, parts: ModelParts) -> FrozenModel:
        """A model of its own, built as the policy was (train/step.py build_reference, train/distill_teacher.py
        build_teacher), frozen: no gradients."""
        for p in parts.parameters():
            p.requires_grad_(False)
        parts.train(False)
        return cls(parts)

    @classmethod
    def adapters_off(cls, parts: ModelParts) -> FrozenModel:
        """The policy's own parts with its LoRA adapters off: the model the adapters started from."""
        return cls(parts, lambda: adapters_off(parts.parts))

    @classmethod
    def starting_weights(cls, parts: ModelParts, lora: bool) -> FrozenModel:
        """The policy's own parts before its first step, which are the reference (`reference: precomputed`'s one
        pass): with LoRA, its adapters off (the base they start from)."""
        return cls(parts, (lambda: adapters_off(parts.parts)) if lora else contextlib.nullcontext)

    @property
    def pipelined(self) -> bool:
        """Its stages are split over pipeline ranks: it runs through `map_logits`, never inside the loss."""
        return self.parts.env.pp_size > 1

    @torch.no_grad()
    def copy_weights_from(self, parts: ModelParts) -> None:
        """Take the policy's current weights (same layout: shard for shard), e.g. the run's starting weights."""
        if not self.owns_weights:
            return
        mine = dict(self.parts.named_parameters())
        for name, p in parts.named_parameters():
            target = mine[name]
            if hasattr(target, "to_local"):
                target.to_local().copy_(p.to_local())
            else:
                target.copy_(p)

    @torch.no_grad()
    def map_logits(self, inputs: torch.Tensor, documents: torch.Tensor | None, n_micro: int, fn: Callable) -> list:
        """[fn(logits, i) for each of the n_micro micro-batches of this rank's rows], forward only, in eval mode,
        with the policy's autocast and (tensor parallelism) its vocab-sharded loss context. Under pipeline
        parallelism the stages are walked forward-only for every micro-batch (parallel/pipeline_forward.py), the
        same micro-batches the policy's schedule then runs: the list is on the rank holding the last stage, where
        the policy's loss reads it, and [] on the others. Its gathered weights are freed after the last."""
        try:
            with self._forward():
                if self.pipelined:
                    if documents is not None:  # config validation refuses packing with pipeline_stage > 1
                        raise ValueError("packed documents are not supported with pipeline parallelism")
                    return pipeline_forward(self.parts, inputs, n_micro, fn)
                return self._micro_batches(inputs, documents, n_micro, fn)
        finally:
            self._free_gathered()

    def expect_micro_batches(self, n_micro: int) -> None:
        """This step calls `micro_batch_logits` n_micro times: the gathered weights are freed after the last."""
        self.micro_batches_left = n_micro

    @torch.compiler.disable  # the policy's loss may be compiled (parallel/parallelize.py): this model stays out
    @torch.no_grad()
    def micro_batch_logits(self, inputs: torch.Tensor, documents: torch.Tensor | None) -> torch.Tensor:
        """One micro-batch's logits, without pipeline parallelism; called inside the policy's loss, so under its
        loss context (vocab-sharded logits with tensor parallelism), which is not entered again here. The gathered
        weights stay for the step's next micro-batch, and are freed after its last (expect_micro_batches; a call
        beyond those frees them too)."""
        model = self.parts.parts[0]
        with self._forward(), self.parts.autocast():
            logits = model(inputs) if documents is None else model(inputs, documents=documents)
        self.micro_batches_left -= 1
        if self.micro_batches_left <= 0:
            self._free_gathered()
        return logits

    @contextlib.contextmanager
    def _forward(self):
        """Eval mode (the policy's parts go back to training after), its context, the meter's measurement."""
        parts = self.parts
        was_training = parts.parts[0].training
        parts.train(False)
        try:
            with self.context(), self.measure():
                yield
        finally:
            parts.train(was_training)

    def _free_gathered(self) -> None:
        if self.owns_weights:  # the policy's own parts (adapters off) are the policy's backward's to free
            self.parts.reshard()

    def _micro_batches(self, inputs: torch.Tensor, documents: torch.Tensor | None, n_micro: int, fn: Callable):
        model, out = self.parts.parts[0], []
        docs = documents.chunk(n_micro) if documents is not None else [None] * n_micro
        with self.parts.loss_context(), self.parts.autocast():
            for i, (x, d) in enumerate(zip(inputs.chunk(n_micro), docs)):
                logits = model(x) if d is None else model(x, documents=d)
                out.append(fn(logits, i))
                del logits
        return out
