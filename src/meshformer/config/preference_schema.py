"""The `preference_config` section: post-training on preference data (DPO and TRL's loss types, KTO, ORPO, SimPO),
with TRL 1.16's names and LLaMA-Factory's (`pref_beta`, `pref_loss`, `pref_ftx`, `dpo_label_smoothing`,
`kto_chosen_weight`, `kto_rejected_weight`) read as aliases, and the rules that tie it to the rest of the config
(`check_preference`, called by config/validate.py): the reference a method needs, LoRA for `reference: adapter`,
the loss types a method takes, and the data's kind (pairs or KTO examples) where the config names a preprocessed
directory. The losses themselves are train/preference_loss.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from meshformer.config.fields import setting
from meshformer.errors import UserError

METHODS = ("none", "dpo", "kto", "orpo", "simpo")
REFERENCES = ("copy", "adapter", "precomputed", "none")
# TRL 1.16 DPOConfig.loss_type values built (train/preference_loss.py computes each), plus cdpo: the conservative
# sigmoid of TRL <= 0.28 and LLaMA-Factory.
DPO_LOSS_TYPES = (
    "sigmoid",
    "hinge",
    "ipo",
    "robust",
    "exo_pair",
    "nca_pair",
    "bco_pair",
    "sppo_hard",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
    "cdpo",
)
KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")
SECTION = "preference_config"


@dataclass
class PreferenceConfig:
    method: str = setting(
        "none", "Preference post-training: none, dpo (TRL's loss types), kto (unpaired), orpo, simpo.", choices=METHODS
    )
    loss_type: str | list = setting(
        "sigmoid",
        "TRL's loss_type or a list of them, summed (dpo: sigmoid, hinge, ipo, robust...; kto: kto (its default), "
        "apo_zero_unpaired).",
        aliases=("pref_loss",),
    )
    loss_weights: list | None = setting(
        None, "One weight per loss_type of a list (TRL's loss_weights; default 1 each)."
    )
    beta: float = setting(
        0.1, "Inverse temperature: the KL penalty of DPO/KTO, ORPO's lambda, SimPO's reward scale.", gt=0,
        aliases=("pref_beta",),
    )  # fmt: skip
    label_smoothing: float = setting(
        0.0, "Share of pairs assumed flipped, for robust, cdpo and exo_pair (in [0, 0.5)).", ge=0, lt=0.5,
        aliases=("dpo_label_smoothing",),
    )  # fmt: skip
    sft_weight: float = setting(
        0.0, "Weight of an SFT term on the chosen completions (TRL's sft loss type; LLaMA-Factory's pref_ftx).", ge=0,
        aliases=("pref_ftx",),
    )  # fmt: skip
    simpo_gamma: float = setting(0.5, "SimPO's target reward margin gamma.", ge=0)
    desirable_weight: float = setting(
        1.0, "KTO: weight of desirable examples' losses.", gt=0, aliases=("kto_chosen_weight",)
    )
    undesirable_weight: float = setting(
        1.0, "KTO: weight of undesirable examples' losses.", gt=0, aliases=("kto_rejected_weight",)
    )
    reference: str | None = setting(
        None,
        "Reference model: copy, adapter (LoRA off), precomputed, none (default copy for dpo/kto, none for orpo/simpo).",
        choices=(None, *REFERENCES),
    )

    def loss_types(self) -> list[str]:
        return [self.loss_type] if isinstance(self.loss_type, str) else list(self.loss_type)

    def reference_kind(self) -> str:
        return self.reference or ("copy" if self.method in ("dpo", "kto") else "none")


def _refuse(field: str, value, why: str) -> UserError:
    return UserError(f"{SECTION}.{field}={value}: {why}")


def _normalize_llama_factory(pc: PreferenceConfig) -> None:
    """LLaMA-Factory's pref_loss names methods too: orpo and simpo set the method (pref_loss: simpo with no
    method given means method: simpo)."""
    if pc.loss_type in ("orpo", "simpo") and pc.method in ("none", pc.loss_type):
        pc.method, pc.loss_type = pc.loss_type, "sigmoid"
    if pc.loss_type == "kto_pair":
        raise _refuse("loss_type", "kto_pair", "TRL removed it: use method: kto on unpaired data")
    if pc.method == "kto" and pc.loss_type == "sigmoid":  # the default, and LLaMA-Factory's pref_loss for KTO
        pc.loss_type = "kto"


def _check_loss_types(pc: PreferenceConfig) -> None:
    kinds = pc.loss_types()
    allowed = {"dpo": DPO_LOSS_TYPES, "kto": KTO_LOSS_TYPES}.get(pc.method)
    if not kinds or not all(isinstance(k, str) for k in kinds):
        raise _refuse("loss_type", pc.loss_type, "give a loss type name or a list of names")
    if allowed is None:
        if pc.loss_type != "sigmoid":
            raise _refuse("loss_type", pc.loss_type, f"method {pc.method} has one loss of its own: remove loss_type")
        return
    for k in kinds:
        if k not in allowed:
            raise _refuse("loss_type", k, f"not a {pc.method} loss type: choose from {', '.join(allowed)}")
    if pc.method == "kto" and len(kinds) > 1:
        raise _refuse("loss_type", pc.loss_type, "KTO takes one loss type")
    if pc.loss_weights is not None and len(pc.loss_weights) != len(kinds):
        raise _refuse("loss_weights", pc.loss_weights, f"give one weight per loss type ({len(kinds)})")
    if "sigmoid" in kinds and pc.label_smoothing > 0:
        raise _refuse(
            "label_smoothing", pc.label_smoothing, "TRL 1.16's sigmoid has no smoothing: use loss_type: robust, "
            "or cdpo (LLaMA-Factory's and TRL <= 0.28's conservative sigmoid)"
        )  # fmt: skip
    if "exo_pair" in kinds and pc.label_smoothing <= 0:
        raise _refuse("label_smoothing", pc.label_smoothing, "exo_pair needs a value > 0 (TRL suggests 1e-3)")


def _check_reference(pc: PreferenceConfig, lora: bool) -> None:
    ref = pc.reference_kind()
    if pc.method in ("dpo", "kto") and ref == "none":
        raise _refuse("reference", ref, f"{pc.method} compares the policy with a reference: choose copy, adapter "
                      f"or precomputed (reference-free losses: method orpo or simpo)")  # fmt: skip
    if pc.method == "kto" and ref == "precomputed":
        why = "a KTO example's KL row pairs it with another example of its global batch, which the shuffle changes"
        raise _refuse("reference", ref, f"{why}, so its log-probs cannot be stored once: choose copy or adapter")
    if pc.method in ("orpo", "simpo") and ref != "none":
        raise _refuse("reference", ref, f"{pc.method} uses no reference model: remove reference (or set none)")
    if ref == "adapter" and not lora:
        raise _refuse("reference", ref, "the reference is the model with its LoRA adapters off, but LoRA is not on: "
                      "set model.model_config.pet_config.pet_type: lora, or reference: copy")  # fmt: skip


def dataset_kind(data_loader) -> str | None:
    """pairs, unpaired, other (a dataset that is not preference data) or None (unknown: no preprocessed directory
    named, or not there yet): read from its meta.json, nothing else opened."""
    directory = getattr(data_loader, "dataset_dir", "") or ""
    meta_file = Path(directory) / "meta.json" if directory else None
    if meta_file is None or not meta_file.is_file():
        return None
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # opening the dataset reports it
    if not isinstance(meta, dict):
        return None
    return meta.get("kind") if meta.get("format") == "meshformer-preference-v1" else "other"


def _check_data(pc: PreferenceConfig, data_loader) -> None:
    kind = dataset_kind(data_loader)
    where = f"train_dataset.data_loader.dataset_dir={data_loader.dataset_dir!r}"
    if kind == "pairs" and pc.method == "kto":
        raise _refuse("method", "kto", f"{where} holds preference pairs: KTO takes unpaired examples; use method: "
                      f"dpo, or preprocess prompt/completion/label records")  # fmt: skip
    if kind == "unpaired" and pc.method != "kto":
        raise _refuse("method", pc.method, f"{where} holds unpaired (KTO) examples: use method: kto, or preprocess "
                      f"prompt/chosen/rejected pairs")  # fmt: skip
    if kind == "other":
        raise _refuse("method", pc.method, f"{where} is not preference data: preprocess prompt/chosen/rejected "
                      f"records (`meshformer preprocess`)")  # fmt: skip


def check_preference(cfg) -> None:
    """The cross-field rules of preference_config (a no-op with method: none)."""
    pc: PreferenceConfig = cfg.preference_config
    _normalize_llama_factory(pc)
    if pc.method == "none":
        return
    _check_loss_types(pc)
    _check_reference(pc, cfg.model.model_config.pet_config.pet_type == "lora")
    _check_data(pc, cfg.train_dataset.data_loader)
