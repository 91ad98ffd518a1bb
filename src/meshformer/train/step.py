"""One training step and one evaluation, shared by the trainer and the parallel parity suite.

The parity suite (tests/dist/harness.py) proves that every layout gives the single-process numbers; it can only
prove that of the trainer if it runs the trainer's own arithmetic. So the model set-up (`build_parts`), the loss
(`make_loss_fn`), the optimizer and its parameter groups (train/optim.py), the step (`train_step`) and the
validation loss (`evaluate`) live here, and both call them.

Loss normalisation: every micro-batch's loss is a *sum* over its tokens; the step divides by the global number
of counted tokens (all data-parallel ranks, all accumulation and pipeline micro-batches) and multiplies by the
number of ranks the gradient reduction averages over. So loss and gradients are those of one big batch, for
every layout and every accumulation split. Auxiliary losses a module reports (models/aux_loss.py) are sums too,
and get the same scale and the same reductions, or arrive already normalised by the step's global totals (MoE
balancing losses: their gradient scale is the averaging size alone).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from meshformer.backends.cpu import apply_cpu_matmul, retain_freed_host_memory
from meshformer.config.schema import MeshformerConfig
from meshformer.config.validate import SPLIT_BACKWARD_SCHEDULES
from meshformer.dtypes import DTYPE
from meshformer.errors import UserError
from meshformer.models import build_model, materialize
from meshformer.models.aux_loss import AuxLossCollector, StepTotals, collect_aux_losses
from meshformer.models.registry import family_of
from meshformer.models.transforms import ModelTransform, apply_model_transforms
from meshformer.parallel import ModelParts, ParallelEnv, parallelize
from meshformer.parallel.context_parallel import local_sequence
from meshformer.train.distill_step import DistillObjective, trains_distillation
from meshformer.train.frozen_model import FrozenModel
from meshformer.train.hooks import Hooks, StepBatch
from meshformer.train.optim import Optimizers
from meshformer.train.preference_step import PreferenceObjective, check_built, trains_preferences


def make_loss_fn(cfg: MeshformerConfig):
    ignore = cfg.model.model_config.ignore_token_id
    dtype = DTYPE[cfg.model.model_config.softmax_compute_dtype]

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed token cross-entropy; normalising by the global token count is the step's job."""
        return F.cross_entropy(
            logits.flatten(0, 1).to(dtype), labels.flatten(), ignore_index=ignore, reduction="sum"
        ).float()

    return loss_fn


# A loss the parts call in place of the token cross-entropy, with `prepare` and `step_metrics` around the step
Objective = PreferenceObjective | DistillObjective


def make_objective(cfg: MeshformerConfig, env: ParallelEnv) -> Objective | None:
    """The run's objective: a preference run's, a distillation run's (its second model is attached after the
    build: build_reference, train/distill_teacher.py build_teacher), or None (the token cross-entropy)."""
    if trains_preferences(cfg):
        return PreferenceObjective(cfg, env)
    if trains_distillation(cfg):
        return DistillObjective(cfg, env)
    return None


@dataclass
class BuiltModel:
    model: torch.nn.Module  # the whole transformed model, still on the meta device (for counting, plans)
    parts: ModelParts  # this rank's materialized pieces, parallelized
    transforms: list[str]  # names of the model transforms applied, in order
    matmul_note: str = ""  # CPU runs: which library runs the fp32 linear layers, and why (cpu_matmul)
    objective: Objective | None = None  # a preference or distillation run's loss (its parts call it), else None


def build_parts(
    cfg: MeshformerConfig,
    env: ParallelEnv,
    transforms: Iterable[ModelTransform] | None = None,
    run_tokens: int | None = None,
) -> BuiltModel:
    """build_model -> model transforms -> parallelize -> materialize: the one way a run gets its model. `run_tokens`
    (the tokens the whole run trains on) lets `compile: auto` judge whether compiling pays on a CPU. A CPU run also
    keeps the host memory its steps free (`retain_host_memory`, backends/cpu.py), and its fp32 linears may run
    on oneDNN (`cpu_matmul`, backends/cpu.py)."""
    mc = cfg.model.model_config
    if cfg.retain_host_memory and env.device.type == "cpu":
        retain_freed_host_memory()
    model = build_model(mc)
    applied = apply_model_transforms(model, cfg, transforms)
    split_backward = env.pp_size > 1 and cfg.parallel_config.pipeline_schedule in SPLIT_BACKWARD_SCHEDULES
    # After the transforms (LoRA's own linears included), before parallelism wraps anything.
    matmul_note = apply_cpu_matmul(model, cfg.cpu_matmul, env.device, DTYPE[mc.compute_dtype], split_backward)
    run_flops = None if run_tokens is None else run_tokens * family_of(mc).flops_per_token(mc)
    objective = make_objective(cfg, env)
    parts = parallelize(model, cfg, env, objective or make_loss_fn(cfg), run_flops)
    if objective is not None:
        objective.policy_parts = parts  # KTO's KL estimate runs the policy forward only, before the step
    for part in parts.parts:
        materialize(part, env.device, cfg.seed, DTYPE[mc.param_init_type])
    return BuiltModel(model, parts, applied, matmul_note, objective)


def build_reference(cfg: MeshformerConfig, env: ParallelEnv, parts: ModelParts) -> FrozenModel | None:
    """The frozen reference `preference_config.reference` names, beside the policy's `parts` (None: reference-free
    or precomputed): a copy built exactly as the policy (`copy`), or the policy with its LoRA adapters off
    (`adapter`)."""
    check_built(cfg)
    kind = cfg.preference_config.reference_kind()
    if kind == "copy":
        return FrozenModel.frozen(build_parts(cfg, env).parts)
    if kind == "adapter":
        return FrozenModel.adapters_off(parts)
    # precomputed: no model at all; the trainer computes the table before step 1 (train/precomputed_reference.py)
    return None


@dataclass
class StepResult:
    loss: float  # mean token loss of the global batch
    grad_norm: float  # global L2 norm before clipping
    tokens: float  # counted (non-ignored) label tokens of the global batch (a preference step: its pairs)
    skipped: bool = False  # loss or gradient norm not finite: the weights were not updated
    aux_losses: dict[str, float] = field(default_factory=dict)  # name -> its sum / global tokens (models/aux_loss.py)
    metrics: dict[str, float] = field(default_factory=dict)  # what the hooks report (train/hooks.py step_metrics)


def train_step(
    parts: ModelParts,
    optimizer: Optimizers,
    env: ParallelEnv,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    *,
    n_micro: int,
    ignore_index: int,
    max_grad_norm: float | None,
    documents: torch.Tensor | None = None,
    loss_scale: float = 1.0,
    clock=None,
    hooks: Hooks | Iterable = (),
    step: int | None = None,
    objective: Objective | None = None,
) -> StepResult:
    """Forward/backward over this rank's `n_micro` micro-batches, clip, optimizer step, zero the gradients.

    inputs/labels: this rank's rows of the global batch; documents: their document index per position when rows
    pack several samples (attention and rotary positions stay inside each). `hooks` (train/hooks.py) run around
    the forward/backward and before and after the optimizer step, told `step` (metrics.jsonl's number of it);
    activation and memory measurement (train/memory.py MemoryMeter) is one of them.
    `objective` (a preference run's, train/preference_step.py): rows are pairs, the reference runs first, the
    loss is normalised by the global pair count and the step's metrics gain TRL's rewards and log-probs; (a
    distillation run's, train/distill_step.py): the teacher runs first, the loss mixes its divergence with the
    cross-entropy, normalised by the global token count, and the metrics gain both means.
    A non-finite loss or gradient norm skips the optimizer step on every rank (the weights and optimizer states
    stay as they were): one bad batch or overflow must not poison the run. `loss_scale` (fp16, train/loss_scale.py)
    multiplies the loss before backward; the gradients are divided by it before the norm and the update.
    `clock` (observe/timing.StepClock) is lapped at the phase boundaries: fwd_bwd, optim (clip, update, zeroing),
    other (the token-count and loss reductions). Hooks' `before_forward_backward` runs in fwd_bwd's time
    (the MoE balance hook's routing pre-pass).
    """
    hooks = hooks if isinstance(hooks, Hooks) else Hooks(hooks)
    lap = clock.lap if clock is not None else lambda phase: None
    # Context parallel ranks read the same rows and keep their own tokens of them (the documents stay whole: the
    # model's pre-hook needs the row's layout); from here on every loss rank holds different tokens.
    inputs, labels = local_sequence(env, inputs, labels)
    if objective is not None:  # labels become targets (+ the reference's log-probs or the teacher's logits)
        labels, n_tok = objective.prepare(inputs, labels, documents, n_micro)
    else:
        n_tok = env.reduce_sum((labels != ignore_index).sum().to(torch.float64), "loss")
    with hooks.step_context(step):
        # A device scalar, not a Python float: reading the token count here would make the host wait for the
        # device before the step's first kernel, a stall a GPU pays every step (the loss is read once, at the end).
        scale = (env.grad_average_size * loss_scale / n_tok).to(torch.float32)
        # Every loss rank holds the same rows of the same length: the step's totals need no collective. A row is
        # split over the cp ranks, so the step's rows are counted over the batch ranks.
        ranks, cp = env.mesh_size("loss"), env.dims.cp
        rows = float(inputs.shape[0] * env.mesh_size("batch"))
        per_row = (lambda t: env.reduce_sum(t, "cp")) if cp > 1 else None
        totals = StepTotals(float(inputs.numel() * ranks), rows, float(n_micro * ranks), cp, per_row)
        lap("other")
        hooks.before_forward_backward(step, StepBatch(inputs, labels, documents, n_micro))  # in fwd_bwd's time
        unit = env.grad_average_size * loss_scale  # normalised aux losses (models/aux_loss.py)
        with collect_aux_losses(scale, unit, totals) as aux:  # aux losses get the main loss's scale
            micro = hooks.micro_batch_context(step)
            loss_sum = parts.forward_backward(inputs, labels, n_micro, scale, documents=documents, micro_context=micro)
        lap("fwd_bwd")
    if loss_scale != 1.0:
        parts.scale_grads_(1.0 / loss_scale)
    loss_t = env.reduce_sum(loss_sum.to(torch.float64), "loss") / n_tok
    aux_names, aux_t = _reduced_aux_losses(parts, env, aux, n_tok)
    lap("other")
    norm_t = parts.clip_grad_norm_(max_grad_norm)
    hooks.before_optimizer_step(step)
    loss, grad_norm, finite = _update(optimizer, env, loss_t, norm_t, lambda: hooks.after_optimizer_step(step))
    lap("optim")
    aux_losses = dict(zip(aux_names, aux_t.tolist())) if aux_names else {}  # read after the loss: no wait
    metrics = hooks.step_metrics(step)
    if objective is not None:
        metrics.update(objective.step_metrics(n_micro))
    return StepResult(loss, grad_norm, float(n_tok), skipped=not finite, aux_losses=aux_losses, metrics=metrics)


def _update(optimizer: Optimizers, env: ParallelEnv, loss_t, norm_t, after_update) -> tuple[float, float, bool]:
    """The optimizer step unless the loss or the norm is not finite; (loss, grad norm, finite), read once."""
    if optimizer.skips_on_device(env.device):
        # Decided on the device: the host queues the update without waiting for backward, and reads the loss and
        # the norm once, after it (a GPU keeps computing meanwhile).
        bad = (~torch.isfinite(loss_t)).to(torch.float32) + (~torch.isfinite(norm_t)).to(torch.float32)
        bad = env.all_reduce_sum_pp(bad)  # the loss exists on the last stage only; the norm is already global
        optimizer.step(found_inf=(bad > 0).to(torch.float32))
        after_update()
        optimizer.zero_grad(set_to_none=True)
        return loss_t.item(), norm_t.item(), not bad.item()
    # foreach AdamW or host-offloaded states: the step is skipped on the host
    loss, grad_norm = loss_t.item(), norm_t.item()
    finite = math.isfinite(loss) and math.isfinite(grad_norm)
    if env.pp_size > 1:  # the loss exists on the last stage only; the grad norm is already global
        finite = env.all_ok(finite)
    if finite:
        optimizer.step()
        after_update()
    optimizer.zero_grad(set_to_none=True)
    return loss, grad_norm, finite


def _reduced_aux_losses(
    parts: ModelParts, env: ParallelEnv, aux: AuxLossCollector, n_tok: torch.Tensor
) -> tuple[list[str], torch.Tensor | None]:
    """The names reported this step and their sums over the loss mesh and the pipeline stages / global tokens
    (already-normalised ones only summed).

    Every rank must reduce the same names in the same order, and a pipeline stage sees only its own layers'
    names: the ranks agree on the union once, on the first step (models report the same names every step),
    and a rank that lacks one reduces a zero for it. Nothing is read back here."""
    if parts.aux_loss_names is None:
        local = sorted((n, n in aux.normalized) for n in aux.sums)
        pairs = {p for got in env.all_gather_object(local) for p in got}
        parts.aux_loss_names = sorted({n for n, _ in pairs})
        parts.aux_loss_normalized = {n for n, normalized in pairs if normalized}
    names = parts.aux_loss_names
    if set(aux.sums) - set(names):
        raise RuntimeError(
            f"auxiliary losses {sorted(set(aux.sums) - set(names))} were first reported after step one: a model "
            f"reports the same names on every step (models/aux_loss.py)"
        )
    if not names:
        return [], None
    zero = torch.zeros((), dtype=torch.float64, device=n_tok.device)
    sums = torch.stack([aux.sums[n].to(torch.float64) if n in aux.sums else zero for n in names])
    sums = env.all_reduce_sum_pp(env.reduce_sum(sums, "loss"))
    normalized = parts.aux_loss_normalized
    denom = torch.stack([torch.ones_like(n_tok) if n in normalized else n_tok for n in names])
    return names, sums / denom


def clip_threshold(cfg: MeshformerConfig) -> float | None:
    rw = cfg.runner_wrapper
    return rw.max_grad_norm if rw.use_clip_grad else None


def eval_micro_batch(cfg, train_micro_batch: int) -> int:
    """Rows per evaluation forward pass on each data-parallel rank: eval_dataset.batch_size, else the training
    micro-batch. A pipeline's stages receive buffers of the training micro-batch's shape, so there it must be a
    multiple of that (evaluate cuts it into training-sized pieces)."""
    size = cfg.eval_dataset.batch_size or train_micro_batch
    if cfg.parallel_config.pipeline_stage > 1 and size % train_micro_batch:
        raise UserError(
            f"eval_dataset.batch_size={size}: with pipeline_stage {cfg.parallel_config.pipeline_stage} it must be "
            f"a multiple of the training micro-batch ({train_micro_batch}), the shape the stages were built for"
        )
    return size


@torch.no_grad()
def evaluate(
    parts: ModelParts,
    env: ParallelEnv,
    batches: Iterable[tuple[torch.Tensor, ...]],
    micro_batch: int,
    ignore_index: int,
) -> float:
    """Mean token loss over (inputs, labels[, documents]) batches, all data-parallel ranks together; forward only.

    Batches are cut into `micro_batch`-row pieces (eval_micro_batch; pipeline parts cut them further into the
    training micro-batch their stages were built for).
    """
    parts.train(False)
    total = torch.zeros((), dtype=torch.float64, device=env.device)
    count = torch.zeros((), dtype=torch.float64, device=env.device)
    for inputs, labels, *documents in batches:
        inputs, labels = local_sequence(env, inputs, labels)
        if documents and documents[0] is not None:
            for x, y, d in zip(inputs.split(micro_batch), labels.split(micro_batch), documents[0].split(micro_batch)):
                total += parts.eval_loss(x, y, d).to(torch.float64)
        else:
            for x, y in zip(inputs.split(micro_batch), labels.split(micro_batch)):
                total += parts.eval_loss(x, y).to(torch.float64)
        count += (labels != ignore_index).sum()
    parts.train(True)
    return (env.reduce_sum(total, "loss") / env.reduce_sum(count, "loss")).item()
