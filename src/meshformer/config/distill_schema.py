"""The `distill_config` section: logit distillation from a frozen teacher, with TRL 1.16's divergences
(`DistillationTrainer` / GKD's generalized JSD) and the rules that tie it to the rest of the config
(`check_distill`, called by config/validate.py): the teacher exists, its vocabulary is the student's (read from
its config file before anything is built), and the fields agree with each other. The losses themselves are
train/distill_loss.py.

The teacher's vocabulary is read here, from the file that declares it, because a mismatch must be one line at
load time (plan, doctor and train all load the config first), not a shape error deep in the first step: a
Hugging Face directory's config.json (`vocab_size`, or its `text_config`'s), or a meshformer checkpoint's
config.yaml (`model.model_config.vocab_size`; a run's output_dir gives its newest `checkpoint/step_N`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from meshformer.config.fields import setting
from meshformer.errors import UserError

LOSSES = ("forward_kl", "reverse_kl", "jsd")
SECTION = "distill_config"
_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass
class DistillConfig:
    teacher: str = setting(
        "", "Teacher for logit distillation: a meshformer checkpoint (or run output_dir) or a Hugging Face directory "
        "(empty: no distillation).",
    )  # fmt: skip
    loss: str = setting(
        "forward_kl",
        "Divergence: forward_kl KL(teacher||student), reverse_kl KL(student||teacher), jsd (generalized, with beta).",
        choices=LOSSES,
    )
    beta: float = setting(
        0.5, "jsd: the teacher's weight in the mixture m = beta*p_teacher + (1-beta)*p_student (TRL's beta).", gt=0,
        lt=1,
    )  # fmt: skip
    temperature: float = setting(1.0, "Softmax temperature of both models' logits in the divergence.", gt=0)
    alpha: float = setting(
        1.0, "Weight of the divergence against the hard-label cross-entropy: alpha*D + (1-alpha)*CE.", ge=0, le=1
    )
    top_k: int | None = setting(
        None, "Keep only the teacher's top_k logits per token; both models renormalised over them (default: all).",
        ge=1,
    )  # fmt: skip

    @property
    def enabled(self) -> bool:
        return bool(self.teacher)

    def trl_beta(self) -> float:
        """The divergence as TRL 1.16's generalized-JSD `beta`: 0 forward KL, 1 reverse KL, else the JSD's."""
        return {"forward_kl": 0.0, "reverse_kl": 1.0}.get(self.loss, self.beta)


def _refuse(field: str, value, why: str) -> UserError:
    return UserError(f"{SECTION}.{field}={value}: {why}")


def _newest_checkpoint(run_dir: Path) -> Path | None:
    steps = [(int(m.group(1)), p) for p in (run_dir / "checkpoint").glob("step_*") if (m := _STEP_DIR.match(p.name))]
    return max(steps)[1] if steps else None


def _vocab_from_hf(config_json: Path) -> int | None:
    try:
        hf = json.loads(config_json.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(hf, dict):
        return None
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else {}
    vocab = hf.get("vocab_size", text.get("vocab_size"))
    return vocab if isinstance(vocab, int) else None


def _vocab_from_checkpoint(config_yaml: Path) -> int | None:
    try:
        data = yaml.safe_load(config_yaml.read_text(encoding="utf-8"))
        vocab = data["model"]["model_config"]["vocab_size"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return None
    return vocab if isinstance(vocab, int) else None


def teacher_vocab_size(teacher: str) -> tuple[int | None, str]:
    """(the teacher's vocabulary size or None when its config does not say, the file read); refuses a path that
    is neither a Hugging Face directory nor a meshformer checkpoint or run."""
    p = Path(teacher)
    if not p.is_dir():
        raise _refuse("teacher", repr(teacher), "no such directory: give a meshformer checkpoint, a run's "
                      "output_dir or a Hugging Face model directory")  # fmt: skip
    if (p / "config.json").is_file():
        return _vocab_from_hf(p / "config.json"), str(p / "config.json")
    ckpt = p if (p / "config.yaml").is_file() else _newest_checkpoint(p)
    if ckpt is None or not (ckpt / "config.yaml").is_file():
        raise _refuse("teacher", repr(teacher), "holds neither config.json (a Hugging Face model) nor a meshformer "
                      "checkpoint's config.yaml (checkpoint/step_N)")  # fmt: skip
    return _vocab_from_checkpoint(ckpt / "config.yaml"), str(ckpt / "config.yaml")


def check_distill(cfg) -> None:
    """The cross-field rules of distill_config (a no-op without a teacher)."""
    dc: DistillConfig = cfg.distill_config
    if not dc.enabled:
        return
    vocab = cfg.model.model_config.vocab_size
    method = cfg.preference_config.method
    if method != "none":
        raise _refuse("teacher", repr(dc.teacher), f"distillation and preference_config.method={method} in one "
                      f"run are not supported: run them one after the other")  # fmt: skip
    pc = cfg.parallel_config
    for name, degree in (("context_parallel", pc.context_parallel), ("expert_parallel", pc.expert_parallel)):
        if degree > 1:
            raise _refuse("teacher", repr(dc.teacher), f"the teacher does not run under parallel_config.{name}="
                          f"{degree} yet: use data, FSDP, tensor or pipeline parallelism")  # fmt: skip
    if dc.top_k is not None and dc.top_k > vocab:
        raise _refuse("top_k", dc.top_k, f"more than the vocabulary ({vocab}): lower it, or remove it to keep all")
    teacher_vocab, where = teacher_vocab_size(dc.teacher)
    if teacher_vocab is None:
        raise _refuse("teacher", repr(dc.teacher), f"{where} names no vocab_size: the teacher's vocabulary must be "
                      f"known to match the student's")  # fmt: skip
    if teacher_vocab != vocab:
        raise _refuse("teacher", repr(dc.teacher), f"its vocabulary has {teacher_vocab} tokens ({where}), the "
                      f"student's {vocab}: logit distillation needs the same tokenizer; pick a teacher of the same "
                      f"family or vocabulary")  # fmt: skip
