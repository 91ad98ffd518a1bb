"""Parity harness: the trainer's own step on fixed tokens, in one process (the reference) or under torchrun.

It builds, steps and evaluates only through meshformer.train.step (`build_parts`, `train_step`, `evaluate`) and
meshformer.train.optim (`Optimizers`, `Schedule`), the functions the trainer calls, so the suite proves the
trainer's arithmetic: loss function, weight-decay groups, global-token normalisation, clipping. A test fails if
this file grows its own. What the trainer adds around them (the dataset, the per-rank batch slices, metrics) is
replaced here by fixed random tokens, each data-parallel rank taking its contiguous slice of the global batch.
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

from meshformer.config.load import load_config
from meshformer.interop.base_model import BASE_MODEL_SOURCES
from meshformer.models.transforms import ModelTransform
from meshformer.parallel import init_parallel
from meshformer.train.distill_step import METRICS as DISTILL_METRICS
from meshformer.train.distill_step import DistillObjective
from meshformer.train.distill_teacher import build_teacher
from meshformer.train.loss_scale import LossScaler
from meshformer.train.memory import MemoryMeter
from meshformer.train.moe_balance import MoeBalanceHook
from meshformer.train.optim import Optimizers, Schedule
from meshformer.train.precomputed_reference import PrecomputedReference, reference_table
from meshformer.train.step import build_parts, build_reference, clip_threshold, evaluate, train_step
from gather_probe import GatherProbe
from parity_cases import (
    BALANCE as BALANCE,
)
from parity_cases import (
    CASES as CASES,
)
from parity_cases import (
    DISTILL_TEACHER_ENV as DISTILL_TEACHER_ENV,
)
from parity_cases import (
    DISTILL_VARIANTS as DISTILL_VARIANTS,
)
from parity_cases import (
    DROP as DROP,
)
from parity_cases import (
    EP_CASES as EP_CASES,
)
from parity_cases import (
    FP8_FP32 as FP8_FP32,
)
from parity_cases import (
    FP8_VARIANTS as FP8_VARIANTS,
)
from parity_cases import (
    GLOBAL_BATCH as GLOBAL_BATCH,
)
from parity_cases import (
    MODEL as MODEL,
)
from parity_cases import (
    MOE_VARIANTS as MOE_VARIANTS,
)
from parity_cases import (
    PREFERENCE_METRICS as PREFERENCE_METRICS,
)
from parity_cases import (
    PREFERENCE_VARIANTS as PREFERENCE_VARIANTS,
)
from parity_cases import (
    SEQ as SEQ,
)
from parity_cases import (  # noqa: E402  the tables, re-exported: tests read them as harness.X
    STEPS as STEPS,
)
from parity_cases import (
    VARIANTS as VARIANTS,
)
from parity_cases import (
    VOCAB as VOCAB,
)
from parity_cases import (
    WINDOW as WINDOW,
)
from parity_cases import (
    P as P,
)


def variant_cfg(variant: str, case: str | None = None):
    """A variant (VARIANTS, FP8_VARIANTS, PREFERENCE_VARIANTS or DISTILL_VARIANTS) under a case's layout (None: one
    process)."""
    tables = (VARIANTS, FP8_VARIANTS, PREFERENCE_VARIANTS, DISTILL_VARIANTS)
    model = next(table[variant] for table in tables if variant in table)
    overrides = {**model, **(spec_of(case)[0] if case else {})}
    if variant in DISTILL_VARIANTS:
        overrides["distill_config.teacher"] = os.environ[DISTILL_TEACHER_ENV]
    cfg = make_cfg(overrides)
    if variant in FP8_FP32:
        cfg.model.model_config.compute_dtype = "float32"
    return cfg


class Wrapped(nn.Module):
    """A linear one level down inside another module, as a LoRA linear holds its base layer: the tensor-parallel
    plan must still reach it (through tp_subplan), and names, init and checkpoints follow the new path."""

    def __init__(self, base: nn.Module):
        super().__init__()
        self.base_layer = base

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x)

    def tp_subplan(self, style: str) -> dict[str, str]:
        return {"base_layer": style}


def _wrap_decoder_linears(model: nn.Module, cfg) -> None:
    for layer in model.layers.values():
        for block in (layer.self_attn, layer.mlp):
            for name, child in list(block.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(block, name, Wrapped(child))


# Variants that change the model through a model transform (the hook LoRA and friends use).
VARIANT_TRANSFORMS = {"wrapped": [ModelTransform("wrap decoder linears", lambda cfg: True, _wrap_decoder_linears)]}


def spec_of(case: str) -> tuple[dict, int]:
    """(overrides, micro-batches) of a case of CASES or EP_CASES."""
    return CASES[case] if case in CASES else EP_CASES[case]


def world_of(case: str) -> int:
    o = spec_of(case)[0]
    return o.get(P + "data_parallel", 1) * o.get(P + "model_parallel", 1) * o.get(P + "pipeline_stage", 1)


def is_packed(variant: str) -> bool:
    """Whether a variant's rows pack several documents (batches(packed=True))."""
    return variant == "packed" or variant.endswith("_packed")


def make_cfg(overrides: dict):
    args = []
    for k, v in {**MODEL, **overrides}.items():
        if v is DROP:
            continue
        args += [f"--{k}", str(v).lower() if isinstance(v, bool) else str(v)]
    return load_config(None, args)


def batches(packed: bool = False, method: str = "none") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """inputs, labels and (packed) each position's document index: documents of random lengths in every row; a
    preference `method`'s marked labels (data/preference_rows.py): orpo's chosen prompts, kto's undesirable ones."""
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(VOCAB, (STEPS, GLOBAL_BATCH, SEQ + 1), generator=g)
    labels = tokens[..., 1:].clone()
    labels[torch.rand(labels.shape, generator=g) < 0.1] = -100  # ignored positions must not count
    if method == "orpo":  # the first 4 positions of every chosen row: its prompt
        labels[:, 0::2, :4] = tokens[:, 0::2, 1:5] + VOCAB
    if method == "kto":  # every other example undesirable: its own row's labels marked
        own = labels[:, 2::4]
        labels[:, 2::4] = torch.where(own != -100, own + VOCAB, own)
    if not packed:
        return tokens[..., :-1], labels, None
    starts = torch.rand(STEPS, GLOBAL_BATCH, SEQ, generator=g) < 0.2
    starts[..., 0] = False
    return tokens[..., :-1], labels, starts.long().cumsum(-1)


def run(
    cfg, env, n_micro: int, transforms=None, packed: bool = False, arithmetic=None
) -> tuple[list[tuple[float, float]], dict]:
    """(loss and grad norm of every step, then the eval loss; this rank's memory breakdown after the second step).
    `arithmetic`: called with the built ModelParts, a context manager the steps and the evaluation run in (a
    reference that changes how one process computes, tests/dist/fp8_tp_order.py)."""
    built = build_parts(cfg, env, transforms)
    with arithmetic(built.parts) if arithmetic is not None else contextlib.nullcontext():
        return _run_built(built, cfg, env, n_micro, packed)


def _run_built(built, cfg, env, n_micro: int, packed: bool) -> tuple[list[tuple[float, float]], dict]:
    objective = built.objective  # a preference variant's, with its frozen reference at the starting weights
    if isinstance(objective, DistillObjective):  # ... or a distillation variant's, with its teacher
        objective.teacher = build_teacher(cfg, env, BASE_MODEL_SOURCES)
    elif objective is not None:
        objective.reference = build_reference(cfg, env, built.parts)
        if objective.reference is not None:
            objective.reference.copy_weights_from(built.parts)
        elif cfg.preference_config.reference_kind() == "precomputed":
            objective.reference = precomputed_tables(built.parts, objective, cfg, env, n_micro, packed)
    opt = Optimizers(built.parts.parts, cfg)
    meter = MemoryMeter(env, built.parts, opt)
    probe, gathers = None, []  # the teacher's FSDP gathers of each step (tests/parity/test_distill_layouts.py)
    if isinstance(objective, DistillObjective):
        meter.watch_teacher(objective.teacher)  # tests/parity/test_distill_layouts.py holds the planner to it
        probe = GatherProbe(objective.teacher.parts)
    memory = {}

    def measure(step: int) -> None:
        nonlocal memory
        if step < 2:  # the second step's measurement (train/memory.py: MEASURED_STEPS)
            memory = {"stage": env.pp_rank, **meter.record()}
        if probe is not None:
            gathers.append(probe.step_record())

    out = train_steps(
        built.parts, opt, cfg, env, n_micro, range(STEPS), packed, hooks=[meter], after=measure, objective=objective
    )
    if probe is not None:
        memory["teacher_gathers"] = gathers
    biases = router_biases(built.parts)
    if biases:  # MoE routing biases after the last update, by layer (each pipeline stage has its own)
        memory["router_biases"] = biases
    return out + [(evaluate_first(built.parts, cfg, env, n_micro, packed, objective), 0.0)], memory


def precomputed_tables(parts, objective, cfg, env, n_micro: int, packed: bool) -> PrecomputedReference:
    """`reference: precomputed` on the fixed batches: pair p is rows 2k, 2k+1 of step p // (GLOBAL_BATCH / 2)'s
    global batch, k = p % (GLOBAL_BATCH / 2); the table comes from the trainer's pass (reference_table), each
    data-parallel rank computing a share, one forward per training micro-batch of pairs."""
    inputs, labels, documents = batches(packed)
    per_step = GLOBAL_BATCH // 2

    def read(ids: torch.Tensor):
        steps = (ids // per_step).repeat_interleave(2)
        rows = torch.stack([2 * (ids % per_step), 2 * (ids % per_step) + 1], 1).flatten()
        return inputs[steps, rows], labels[steps, rows], None if documents is None else documents[steps, rows]

    lora = cfg.model.model_config.pet_config.pet_type == "lora"
    pairs_per_forward = GLOBAL_BATCH // env.dp_size // n_micro // 2
    table = reference_table(parts, objective, lora, STEPS * per_step, pairs_per_forward, read)
    # every rank holds the computed table, also where its stage is not the last (rank 0 saves it in a run)
    assert bool((table < 0).all()), f"rank {env.rank}: the precomputed table is not the reference's log-probs"
    return PrecomputedReference({"train": table, "validation": table}, {})


def pair_ids(env, step: int) -> torch.Tensor:
    """The sample indices of this data-parallel rank's pairs of `step` (precomputed_tables' numbering)."""
    rows = rows_of(env)
    return step * (GLOBAL_BATCH // 2) + torch.arange(rows.start // 2, rows.stop // 2)


def router_biases(parts) -> dict[str, list[float]]:
    from meshformer.models.init import canonical_name

    # Under tensor parallelism the bias is a DTensor replicated over tp: its local tensor is the whole bias.
    return {
        canonical_name(name): (buf.to_local() if hasattr(buf, "to_local") else buf).tolist()
        for part in parts.parts
        for name, buf in part.named_buffers()
        if name.endswith("e_score_correction_bias")
    }


def rows_of(env) -> slice:
    """This data-parallel rank's contiguous slice of the global batch."""
    per = GLOBAL_BATCH // env.dp_size
    return slice(env.dp_rank * per, (env.dp_rank + 1) * per)


def train_steps(
    parts, opt, cfg, env, n_micro: int, steps: range, packed: bool = False, hooks=(), after=None, objective=None
):
    """The trainer's step on the fixed batches of `steps`: [(loss, grad norm, *auxiliary losses by name, *a
    preference step's metrics)] per step. MoE models get the trainer's balancing hook (loads, bias update), as the
    Trainer registers it; `objective`: a preference run's (rows are pairs: 2k chosen, 2k+1 rejected)."""
    balance = MoeBalanceHook.for_run(cfg, parts, env)
    hooks = [*hooks, *([balance] if balance is not None else [])]
    scaler = LossScaler.from_config(cfg)  # fp16: the trainer's dynamic loss scaling
    schedule = Schedule(opt, cfg, STEPS)
    inputs, labels, documents = batches(packed, cfg.preference_config.method)
    rows = rows_of(env)
    out = []
    for step in steps:
        schedule.apply(step)
        docs = None if documents is None else documents[step, rows].to(env.device)
        if isinstance(getattr(objective, "reference", None), PrecomputedReference):
            objective.reference.select("train", pair_ids(env, step))
        r = train_step(
            parts,
            opt,
            env,
            inputs[step, rows].to(env.device),
            labels[step, rows].to(env.device),
            n_micro=n_micro,
            ignore_index=cfg.model.model_config.ignore_token_id,
            max_grad_norm=clip_threshold(cfg),
            documents=docs,
            hooks=list(hooks),
            step=step + 1,
            loss_scale=scaler.scale,
            objective=objective,
        )
        scaler.update(not r.skipped)
        keys = DISTILL_METRICS if isinstance(objective, DistillObjective) else PREFERENCE_METRICS
        preference = [r.metrics.get(k, 0.0) for k in keys] if objective is not None else []
        out.append((r.loss, r.grad_norm, *(r.aux_losses[k] for k in sorted(r.aux_losses)), *preference))
        if after is not None:
            after(step)
    return out


def evaluate_first(parts, cfg, env, n_micro: int, packed: bool = False, objective=None) -> float:
    """Validation loss (forward only) of the first global batch (a preference run's: its mean pair loss)."""
    inputs, labels, documents = batches(packed, cfg.preference_config.method)
    rows = rows_of(env)
    docs = None if documents is None else documents[0, rows].to(env.device)
    first = [(inputs[0, rows].to(env.device), labels[0, rows].to(env.device), docs)]
    per = GLOBAL_BATCH // env.dp_size
    if objective is not None and not isinstance(objective, DistillObjective):  # distillation validates on tokens
        if isinstance(objective.reference, PrecomputedReference):
            objective.reference.select("validation", pair_ids(env, 0))
        return objective.evaluate(parts, first, per // n_micro // 2)["loss"]
    return evaluate(parts, env, first, per // n_micro, cfg.model.model_config.ignore_token_id)


def run_case(case: str, variant: str = "fp32", world_size: int | None = None):
    """(results on this rank, env, this rank's memory). world_size=1 with case=None: the single-process reference."""
    cfg = variant_cfg(variant, case)
    env = init_parallel(cfg, world_size)
    n_micro = spec_of(case)[1] if case else 1
    out, memory = run(cfg, env, n_micro, VARIANT_TRANSFORMS.get(variant), packed=is_packed(variant))
    return out, env, memory


def write_results(env, results: dict, out_path) -> None:
    """Every rank's findings merged into one json file by rank 0 (each job has its own metrics rank), then shut
    the process group down: the end of a worker's launch."""
    import json

    gathered = env.all_gather_object(results)
    if env.rank == 0:
        out_path.write_text(json.dumps({k: v for r in gathered for k, v in r.items()}))
    env.shutdown()
