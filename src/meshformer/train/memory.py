"""What a rank's memory holds, by component: parameters, gradients, optimizer states and saved activations.

Measured on the first step of every run, so a planner's prediction can be checked against the run itself:
- parameters, gradients, optimizer states: exact byte sums of the distinct storages this rank holds (a DTensor
  counts its local shard), taken right after the first optimizer update, when all three exist;
- activations: the peak of the bytes autograd holds for backward at once (saved-tensor hooks, second step, or the
  first in a one-step run: a pipeline stage's first step also runs torch's shape-inference forward). Under
  gradient accumulation that is one micro-batch; under a pipeline schedule, the micro-batches the stage holds in
  flight. Parameters saved by the layers that use them are not counted again, nor are the weights FSDP gathers
  (which it frees after the forward whoever saved them), even when a layer computes on their local tensor (an
  MoE router and experts under tensor and expert parallelism) rather than on the Parameter;
- a preference run's frozen reference (train/frozen_model.py): its own weights (`reference: copy`; the policy's
  with its adapters off own none) and the peak of the tensors its no_grad forward creates and frees again (the
  logits of a micro-batch, their log-probabilities, autocast's weight copies), counted per operation by a
  dispatch mode since nothing is saved for backward;
- a distillation teacher (a FrozenModel, train/distill_teacher.py), as the reference: its weights, the peak of
  its no_grad forward (one micro-batch's inside the student's loss; under pipeline parallelism its whole pass
  before the student's schedule), and the bytes that forward leaves alive for the loss: its logits (a
  micro-batch's; under pipeline parallelism all of the step's, on the last stage). What the divergence saves for
  the student's backward is the student's: in the activations;
- KTO's KL pass (the policy's no_grad forward over the KL rows, before its step): its peak, as a reference's;
- peak: on a GPU the CUDA allocator's peak; on the CPU (no allocator peak) the states, the second model's weights
  and the larger of the activations and the reference's forward (it runs before the policy's); a teacher's forward
  runs beside the student's activations (inside its loss), or under pipeline parallelism before them with its
  logits kept beside them.

metrics.jsonl gets `mem_params_bytes`, `mem_grads_bytes`, `mem_optim_bytes`, `mem_activations_bytes` and
`peak_mem_bytes` (the metrics rank's), with a reference `mem_reference_bytes` and `mem_reference_forward_bytes`, a
teacher `mem_teacher_bytes`, `mem_teacher_forward_bytes` and `mem_teacher_logits_bytes`, KTO's
`mem_kl_forward_bytes`; `{output_dir}/memory.json` has every rank's breakdown.
"""

from __future__ import annotations

import contextlib
import json
import weakref
from pathlib import Path

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from meshformer.backends.torch_private import dispatch_mode_base, dtensor_local, tree_leaves, view_base
from meshformer.train.metrics import plain_tensors, tensor_bytes


class ActivationCounter:
    """Live and peak bytes of the tensors autograd saves for backward, while `hooks()` is active.

    A storage counts once while any saved tensor on it is alive (keyed by address and size; an address the
    allocator reuses after a release counts again), and stops counting when the last of them is released. A
    parameter or a view of one, and any storage of the model's parameters and buffers
    (the rotary tables, frozen weights), is the model's, not an activation: skipped."""

    def __init__(self, model_storages: set[int] | None = None, gathering: list[torch.nn.Module] | None = None):
        self.live = 0
        self.peak = 0
        self._holders: dict[tuple[int, int], int] = {}
        self._model = model_storages or set()  # addresses of the model's parameters and buffers
        self._gathering = gathering or []  # FSDP units: their parameters are gathered into storages of their own
        self._gathered: set[StorageWeakRef] = set()  # those storages (stable: FSDP resizes them, never replaces)

    def _note_gathered(self, module, args) -> None:
        # runs after FSDP's own pre-forward hook (prepended), which registers the unsharded parameters
        with torch.no_grad():
            for p in module.parameters():
                local = p.to_local() if hasattr(p, "to_local") else p
                self._gathered.add(StorageWeakRef(local.untyped_storage()))

    def _release(self, key: tuple[int, int], nbytes: int) -> None:
        left = self._holders.get(key, 0) - 1
        if left > 0:
            self._holders[key] = left
        else:
            self._holders.pop(key, None)
            self.live -= nbytes

    def pack(self, t):
        base = view_base(t)
        if isinstance(base, torch.nn.Parameter):
            return t  # a parameter, or a view of one (a linear saves weight.t())
        if not (t.is_floating_point() or t.dtype == torch.bool):
            return t  # token ids and labels: the batch, which exists anyway (often a view of all micro-batches)
        if t.device.type == "meta":
            return t  # a pipeline stage infers shapes with a forward pass on the meta device: no memory
        local = dtensor_local(t)  # a DTensor: its shard
        if isinstance(getattr(local, "elem", None), torch.Tensor):
            local = local.elem  # a wrapper subclass (AsyncCollectiveTensor): the tensor it wraps
        try:
            st = local.untyped_storage()
            key, nbytes = (st.data_ptr(), st.nbytes()), st.nbytes()
            if key[0] in self._model:  # a buffer (the rotary tables) or a frozen weight: the model's memory
                return t
            if self._gathered and StorageWeakRef(st) in self._gathered:  # a gathered weight's local tensor
                return t
            weakref.finalize(t, self._release, key, nbytes)
        except (RuntimeError, NotImplementedError, TypeError):
            return t
        if key in self._holders:
            self._holders[key] += 1
        else:
            self._holders[key] = 1
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        return t

    def hold(self, tensors) -> None:
        """Count storages that stay alive through the step whatever autograd does (a pipeline stage's buffers for
        the inputs it receives, one per micro-batch, which saved tensors may or may not be views of)."""
        for t in tensors:
            st = t.untyped_storage()
            key = (st.data_ptr(), st.nbytes())
            if key not in self._holders:
                self.live += st.nbytes()
                self.peak = max(self.peak, self.live)
            self._holders[key] = self._holders.get(key, 0) + 1  # one count never released

    @contextlib.contextmanager
    def hooks(self):
        """Count while active: autograd's saved tensors, and what selective recompute keeps (parallel/recompute.py)."""
        from meshformer.parallel.recompute import KEPT_LISTENERS

        KEPT_LISTENERS.append(self.pack)
        handles = [m.register_forward_pre_hook(self._note_gathered) for m in self._gathering]
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
                yield
        finally:
            KEPT_LISTENERS.remove(self.pack)
            for h in handles:
                h.remove()


class ForwardCounter(dispatch_mode_base()):
    """While active, every tensor an operation returns goes through `counter.pack` (ActivationCounter's
    bookkeeping: a storage counts while a tensor on it lives; the model's parameters and buffers never): the live
    and peak bytes of a forward that saves nothing for backward."""

    def __init__(self, counter: ActivationCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.counter.pack(t)
        return out


def counter_for(parts) -> ActivationCounter:
    """A counter for one step of `parts` (ModelParts): the storages of their parameters (a DTensor's local shard)
    and buffers are the model's, and a pipeline stage's receive buffers are held through the step."""
    model = [*parts.parameters(), *(b for part in parts.parts for b in part.buffers())]
    locals_ = (p for t in model for p in plain_tensors(t))
    from torch.distributed.fsdp import FSDPModule

    gathering = [m for part in parts.parts for m in part.modules() if isinstance(m, FSDPModule)]
    counter = ActivationCounter({t.untyped_storage().data_ptr() for t in locals_}, gathering)
    counter.hold(parts.persistent_buffers())
    return counter


# memory.json's keys of a second model (the metrics' names without `mem_`)
SECOND_KEYS = ("reference_bytes", "reference_forward_bytes", "teacher_bytes", "teacher_forward_bytes",
               "teacher_logits_bytes", "kl_forward_bytes")  # fmt: skip

# Activations are measured on the first two steps and the second is reported: a pipeline stage's first step also
# runs a set-up forward (torch infers the shapes it sends) whose saved tensors live through that step only.
MEASURED_STEPS = 2


class MemoryMeter:
    """A rank's memory breakdown from its first steps on (see the module docstring)."""

    def __init__(self, env, parts, optimizer):
        self.env, self.parts, self.optimizer = env, parts, optimizer
        self.counter: ActivationCounter | None = None
        self.state: dict[str, int] | None = None
        self.activations = 0
        self.measured = 0  # steps whose activations were measured
        self._written = 0
        self.second = None  # a frozen second model: a preference run's reference or a distillation teacher
        self.second_name = ""  # "reference" or "teacher": the metrics' names
        self.second_weights = 0
        self.second_forward = 0  # its forward's peak
        self.second_left = 0  # what its forward leaves alive for the loss (a teacher's logits)
        self.second_beside = False  # its forward runs beside the policy's activations (a teacher inside the loss)
        self.kl_forward = None  # KTO's KL pass: the policy's no_grad forward over the KL rows (watch_kl_pass)

    def watch_reference(self, reference) -> None:
        """Measure `reference` (a FrozenModel): the bytes of its own weights, and its forward's peak on the first
        MEASURED_STEPS steps."""
        self._watch("reference", reference, reference.owns_weights)

    def watch_teacher(self, teacher) -> None:
        """Measure a distillation `teacher` (a FrozenModel, train/distill_teacher.py): its weights, its forward's
        peak and the logits it leaves for the loss."""
        self._watch("teacher", teacher, teacher.owns_weights)
        self.second_beside = not teacher.pipelined

    def watch_kl_pass(self, objective) -> None:
        """Measure KTO's KL pass (train/preference_step.py): the peak of the policy's no_grad forward over the KL
        rows, which runs before the policy's step like the reference's."""
        self.kl_forward = 0
        objective.kl_measure = self._measure_kl

    @contextlib.contextmanager
    def _forward_counter(self, parts):
        """A counter of the tensors a no_grad forward of `parts` makes (None after the measured steps)."""
        if self.measured >= MEASURED_STEPS:
            yield None
            return
        counter = counter_for(parts)
        with ForwardCounter(counter):
            yield counter

    @contextlib.contextmanager
    def _measure_kl(self):
        with self._forward_counter(self.parts) as counter:
            yield
        if counter is not None:
            self.kl_forward = max(self.kl_forward, counter.peak)

    def _watch(self, name: str, model, owns_weights: bool) -> None:
        self.second, self.second_name = model, name
        self.second_weights = tensor_bytes(model.parts.parameters()) if owns_weights else 0
        model.measure = self._measure_second

    @contextlib.contextmanager
    def _measure_second(self):
        with self._forward_counter(self.second.parts) as counter:
            yield
        if counter is not None:
            self.second_forward = max(self.second_forward, counter.peak)
            self.second_left = max(self.second_left, counter.live)  # made in the forward, still alive after it

    def capture(self):
        """Saved-tensor hooks for this step's forward/backward (the first MEASURED_STEPS steps), else None."""
        if self.measured >= MEASURED_STEPS:
            return None
        self.counter = counter_for(self.parts)
        return self.counter.hooks()

    def after_update(self) -> None:
        """Right after the first optimizer update: parameters, gradients and optimizer states all exist."""
        if self.state is not None:
            return
        params = list(self.parts.parameters())
        self.state = {
            "params_bytes": tensor_bytes(params),
            "grads_bytes": tensor_bytes(p.grad for p in params),
            "optimizer_bytes": tensor_bytes(self.optimizer.state_tensors()),
        }

    # A training hook (train/hooks.py): the step runs its forward/backward under `capture` and calls
    # `after_update` right after the optimizer step.
    def step_context(self, step: int | None):
        return self.capture()

    def after_optimizer_step(self, step: int | None) -> None:
        self.after_update()

    def record(self) -> dict[str, int]:
        """The metrics.jsonl fields of this step."""
        if self.counter is not None:
            self.activations, self.counter = self.counter.peak, None
            self.measured += 1
        s = self.state or {"params_bytes": 0, "grads_bytes": 0, "optimizer_bytes": 0}
        if self.env.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.env.device)
        else:
            peak = s["params_bytes"] + s["grads_bytes"] + s["optimizer_bytes"] + self.second_weights + self._working()
        return {
            "peak_mem_bytes": peak,
            "mem_params_bytes": s["params_bytes"],
            "mem_grads_bytes": s["grads_bytes"],
            "mem_optim_bytes": s["optimizer_bytes"],
            "mem_activations_bytes": self.activations,
            **self._second_record(),
        }

    def _working(self) -> int:
        """The CPU's peak above the resident states: the activations with what the second model adds."""
        if self.second_name == "teacher" and self.second_beside:
            return self.activations + self.second_forward  # inside the student's loss, its activations all saved
        if self.second_name == "teacher":  # its pass first; its logits wait beside the student's activations
            return max(self.activations + self.second_left, self.second_forward)
        return max(self.activations, self.second_forward, self.kl_forward or 0)  # they run before the policy's

    def _second_record(self) -> dict[str, int]:
        out = {} if self.kl_forward is None else {"mem_kl_forward_bytes": self.kl_forward}
        if self.second is None:
            return out
        name = self.second_name
        out |= {f"mem_{name}_bytes": self.second_weights, f"mem_{name}_forward_bytes": self.second_forward}
        if name == "teacher":
            out["mem_teacher_logits_bytes"] = self.second_left
        return out

    def write_report(self, out_dir: Path, record: dict[str, int]) -> None:
        """Every rank's breakdown into {out_dir}/memory.json after each measured step (a collective: every rank
        calls it; the last write holds the steady state)."""
        if self._written >= self.measured:
            return
        self._written = self.measured
        mine = {
            "stage": self.env.pp_rank,
            "params_bytes": record["mem_params_bytes"],
            "grads_bytes": record["mem_grads_bytes"],
            "optimizer_bytes": record["mem_optim_bytes"],
            "activations_bytes": record["mem_activations_bytes"],
            "peak_bytes": record["peak_mem_bytes"],
        }
        for key in SECOND_KEYS:
            if f"mem_{key}" in record:
                mine[key] = record[f"mem_{key}"]
        ranks = self.env.all_gather_object(mine)
        if self.env.rank == 0:
            report = {str(r): v for r, v in enumerate(ranks)}
            (Path(out_dir) / "memory.json").write_text(json.dumps(report, indent=1) + "\n")
