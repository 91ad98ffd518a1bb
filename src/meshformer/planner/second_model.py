"""The second model of a post-training run, as the planner counts it: the frozen reference of a preference run
(preference_config.reference) or the distillation teacher (distill_config.teacher), and what the run's data doubles.

  reference: copy         a frozen copy of the policy's starting weights, built and split as the policy is (same
                          pipeline pieces, tensor-parallel plan and FSDP shards) in the stored dtype
                          (param_init_type): the policy's parameter bytes again, no gradients, no optimizer states,
                          no saved activations (its forward runs under no_grad).
  reference: adapter      the policy with its LoRA adapters off: nothing more on the device.
  a reference's forward   (copy and adapter) runs for the step's micro-batches before the policy's, one at a time,
                          under no_grad: nothing is kept, but on the last stage a micro-batch's logits live with
                          their cast to softmax_compute_dtype (when it differs) and the log-softmax the per-sequence
                          log-probabilities take: T x vocab / tp x (compute + softmax + softmax bytes). The
                          policy's activations do not exist yet, so this is the step's peak beside the resident
                          states when it exceeds the policy's working memory.
  reference: precomputed  nothing on the device; on disk, one float64 log-probability per sequence of every split
                          (a pair's chosen and rejected: 16 bytes a pair; KTO: 8 bytes an example and 8 for its
                          KL partner), stored with the run.
  KTO's KL pass           z0 needs the policy's log-probabilities of the KL rows before the step: the policy runs
                          forward only over them (half the micro-batch's rows), as a reference's forward does; its
                          peak is the reference's for half the tokens (below the reference's own: counted as
                          the larger of the two).
  reference: none         nothing (ORPO, SimPO).
  teacher                 the teacher's weights, its own model built and split under the run's layout in
                          param_init_type (no gradients or optimizer states). Its no_grad forward runs inside the
                          student's loss, one micro-batch at a time, beside the student's saved activations: its
                          peak is the larger of its head's (the logits, T x vocab / tp in the compute dtype, with the
                          final norm's output and autocast's copies of the head's input and weight) and an MLP's
                          (three T x ffn / tp tensors), and it leaves the logits for the loss, beside which the
                          divergence makes its float32 temporaries (planner/distill_memory.py; what it saves for the
                          student's backward is counted in the activations). Under pipeline parallelism its stages
                          run for all the step's micro-batches before the student's schedule and the last stage
                          keeps their logits in float32 with the labels, rows x seq x (1 + vocab / tp), through
                          the schedule; the loss takes a contiguous float32 copy of one micro-batch's.
Preference pairs put a pair's chosen and rejected in the same micro-batch: `train_dataset.batch_size` counts pairs,
so activations and logits are those of twice the rows (`rows_per_sample`); KTO examples are one row each.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

from meshformer.config.schema import MeshformerConfig
from meshformer.dtypes import DTYPE
from meshformer.parallel.dims import ParallelDims

# every preference sample is two rows: a pair, or a KTO example and its KL sequence (data/preference_rows.py)
TWO_ROW_METHODS = ("dpo", "kto", "orpo", "simpo")
LOGPROB_BYTES = 8  # one float64 log-probability per sequence (train/precomputed_reference.py keeps rewards exact)


@dataclass
class SecondModel:
    """One rank's share of the second model (the most loaded pipeline rank's where they differ)."""

    kind: str  # "reference: copy", "reference: adapter", "reference: precomputed", "teacher" or "" (none)
    weights_bytes: int = 0  # frozen weights on this rank's device
    logits_bytes: int = 0  # the teacher's logits kept for the loss on the last stage (under pp: the step's)
    forward_bytes: int = 0  # its no_grad forward's peak: what one micro-batch (a teacher's pp pass: all) allocates
    disk_bytes: int | None = None  # precomputed reference log-probs on disk (None: the dataset's size is unknown)
    beside_bytes: int = 0  # what it adds beside the policy's working memory at its peak (the logits column)

    def as_dict(self) -> dict:
        return {
            "kind": self.kind,
            "weights_bytes": self.weights_bytes,
            "logits_bytes": self.logits_bytes,
            "forward_bytes": self.forward_bytes,
            "disk_bytes": self.disk_bytes,
            "beside_bytes": self.beside_bytes,
        }


def rows_per_sample(cfg: MeshformerConfig) -> int:
    """Rows of a micro-batch per sample of train_dataset.batch_size: 2 for preference samples, else 1."""
    return 2 if cfg.preference_config.method in TWO_ROW_METHODS else 1


def reference_kind(cfg: MeshformerConfig) -> str:
    """The preference reference as the run will use it ("" when the run is not a preference run)."""
    pc = cfg.preference_config
    return "" if pc.method == "none" else pc.reference_kind()


def _element_size(name: str) -> int:
    import torch

    return torch.empty((), dtype=DTYPE[name]).element_size()


def _teacher_model_config(teacher: str):
    """The teacher's model config: a Hugging Face directory's config.json (the weights need not be there to plan),
    else the meshformer checkpoint's config.yaml (train/finetune.py reads both for load_checkpoint)."""
    import json
    from pathlib import Path

    config_json = Path(teacher) / "config.json"
    if not config_json.is_file():
        from meshformer.train.finetune import base_model_config

        return base_model_config(teacher)
    from meshformer.config.load import from_dict
    from meshformer.config.model_schema import ModelConfig
    from meshformer.interop.hf_config import model_config_from_hf

    hf = json.loads(config_json.read_text(encoding="utf-8"))  # its vocab_size was read by the config's check
    return from_dict(ModelConfig, model_config_from_hf(hf, str(config_json)), ("model", "model_config"), [])


def teacher_config(cfg: MeshformerConfig) -> MeshformerConfig:
    """The run's config with the teacher's model in place of the student's: its own shape (read from its
    config.json or checkpoint config.yaml), the run's dtypes and sequence length, no LoRA (it is frozen whole)."""
    student = cfg.model.model_config
    teacher = _teacher_model_config(cfg.distill_config.teacher)
    for name in ("param_init_type", "compute_dtype", "softmax_compute_dtype", "layernorm_compute_dtype", "seq_length"):
        setattr(teacher, name, getattr(student, name))
    teacher.pet_config = type(student.pet_config)()
    out = copy.copy(cfg)
    out.model = copy.copy(cfg.model)
    out.model.model_config = teacher
    return out


def _precomputed_disk_bytes(cfg: MeshformerConfig) -> int | None:
    import json
    from pathlib import Path

    directory = getattr(cfg.train_dataset.data_loader, "dataset_dir", "") or ""
    meta_file = Path(directory) / "meta.json"
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8")) if directory else None
        samples = [split["samples"] for split in meta["splits"].values()]  # training and validation pairs
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not all(isinstance(n, int) for n in samples):
        return None
    return sum(samples) * 2 * LOGPROB_BYTES  # pairs: chosen and rejected; KTO: the example and its KL partner


def reference_forward_bytes(cfg: MeshformerConfig, dims: ParallelDims, tokens: int, last: bool) -> int:
    """A reference's no_grad forward of one micro-batch at its peak (the module docstring): the logits, their cast
    to softmax_compute_dtype and its log-softmax (train/preference_step.row_logps); 0 before the last stage."""
    if not last:
        return 0
    mc = cfg.model.model_config
    compute, softmax = _element_size(mc.compute_dtype), _element_size(mc.softmax_compute_dtype)
    cast = softmax if mc.softmax_compute_dtype != mc.compute_dtype else 0
    return tokens * math.ceil(mc.vocab_size / dims.tp) * (compute + cast + softmax)


def _teacher(cfg: MeshformerConfig, dims: ParallelDims, pp_rank: int, tokens: int, last: bool, n_micro: int):
    """The teacher on one rank (the module docstring)."""
    from meshformer.planner.distill_memory import loss_working_bytes
    from meshformer.planner.memory import states_bytes

    tcfg = teacher_config(cfg)
    weights = states_bytes(tcfg, dims, pp_rank)[0]
    if not last:
        return SecondModel("teacher", weights)
    mc = tcfg.model.model_config
    vocab = math.ceil(mc.vocab_size / dims.tp)
    compute, norm = _element_size(mc.compute_dtype), _element_size(mc.layernorm_compute_dtype)
    casts = (tokens + vocab) * mc.hidden_size * compute if mc.compute_dtype != mc.param_init_type else 0
    head = tokens * (vocab * compute + mc.hidden_size * norm) + casts
    mlp = 3 * tokens * math.ceil(mc.intermediate_size / dims.tp) * compute
    forward = max(head, mlp)
    divergence = loss_working_bytes(cfg, tokens, vocab)
    if dims.pp == 1:  # inside the student's loss: its forward, then its logits with the divergence's temporaries
        logits = tokens * vocab * compute
        return SecondModel("teacher", weights, logits, forward, beside_bytes=max(forward, logits + divergence))
    kept = n_micro * tokens * (1 + vocab) * 4  # float32, with the labels
    copy = tokens * vocab * 4  # the loss's contiguous copy of one micro-batch's
    return SecondModel("teacher", weights, kept, kept + forward, beside_bytes=kept + copy + divergence)


def second_model(
    cfg: MeshformerConfig, dims: ParallelDims, pp_rank: int, tokens: int, last: bool, n_micro: int = 1
) -> SecondModel:
    """The second model's bytes on one rank of pipeline rank `pp_rank`. tokens: of one micro-batch on this rank
    (rows x seq_length / cp); last: the rank computes the loss (holds the last stage); n_micro: the step's
    micro-batches on this rank (under pipeline parallelism the teacher's logits of all of them wait on the last
    stage, in float32, for the student's schedule: train/distill_step.py)."""
    from meshformer.planner.memory import states_bytes

    if cfg.distill_config.enabled:
        return _teacher(cfg, dims, pp_rank, tokens, last, n_micro)
    ref = reference_kind(cfg)
    # KTO's KL pass: the policy forward only over the KL rows (half the rows), before its step as the reference's
    kl = reference_forward_bytes(cfg, dims, tokens // 2, last) if cfg.preference_config.method == "kto" else 0
    forward = max(reference_forward_bytes(cfg, dims, tokens, last), kl)
    if ref == "copy":
        return SecondModel("reference: copy", states_bytes(cfg, dims, pp_rank)[0], forward_bytes=forward)
    if ref == "precomputed":
        return SecondModel("reference: precomputed", disk_bytes=_precomputed_disk_bytes(cfg))  # KTO refuses it
    if ref == "adapter":
        return SecondModel("reference: adapter", forward_bytes=forward)
    return SecondModel("")


def reference_knobs(cfg: MeshformerConfig) -> list[tuple[str, dict]]:
    """What keeps a preference run's reference off the device, as (advice, config changes): `adapter` where LoRA is
    on (the policy with its adapters off), `precomputed` always (log-probs computed once before training)."""
    if reference_kind(cfg) != "copy":
        return []
    options = []
    if cfg.model.model_config.pet_config.pet_type == "lora":
        options.append(
            (
                "preference_config.reference: adapter (the reference is the policy with its LoRA adapters off: no "
                "second copy of the weights)",
                {"preference_config.reference": "adapter"},
            )
        )
    disk = _precomputed_disk_bytes(cfg)
    where = f"{disk / (1 << 20):.1f} MiB on disk" if disk is not None else f"{2 * LOGPROB_BYTES} bytes a pair on disk"
    options.append(
        (
            f"preference_config.reference: precomputed (reference log-probs computed in one pass before training, "
            f"{where}; no reference on the device)",
            {"preference_config.reference": "precomputed"},
        )
    )
    return options
