"""The preference step (train/preference_step.py, the trainer's `preference_config.method`) against TRL 1.16: a
transformers-made tiny Llama and a small preference JSONL, full-batch steps (so the order cannot differ), the same
AdamW, schedule and clipping; meshformer's per-step loss equals `trl.DPOTrainer`'s for each loss type, and
`trl.experimental.cpo`'s SimPO (cpo_alpha 0), `trl.experimental.orpo`'s ORPO and `trl.KTOTrainer`'s KTO (unpaired
examples, its KL estimate from the batch's mismatched prompt/completion pairs), within 1e-5 relative (fp32), and
the logged rewards, margins, accuracies, log-probs (ORPO: nll_loss and log odds; KTO: kl) agree. (Layouts:
tests/parity/test_preference_layouts.py.)"""

from __future__ import annotations

import json

import pytest

from conftest import full_batch_overrides, preference_run_dir, rel, tiny_overrides, trl_full_batch_args
from meshformer.cli.train_cmd import run_training  # load_checkpoint: a Hugging Face directory
from meshformer.config import load_config

trl = pytest.importorskip("trl")

RECORDS = [
    {"prompt": "The king said", "chosen": " to be or not", "rejected": " hello there"},
    {"prompt": "What light", "chosen": " through yonder window breaks", "rejected": " is that"},
    {"prompt": "O Romeo,", "chosen": " wherefore art thou", "rejected": " where are you"},
    {"prompt": "Good night, sweet ", "chosen": "prince", "rejected": "king"},
    {"prompt": "Now is the winter", "chosen": " of our discontent", "rejected": " of the year"},
    {"prompt": "All the world", "chosen": "'s a stage", "rejected": " is round"},
]
# unpaired (KTO) examples, desirable and not, unbalanced; completions of several lengths, so the KL sequences (each
# prompt with the previous example's completion) differ from the examples' own
KTO_RECORDS = [
    {"prompt": "The king said", "completion": " to be or not", "label": True},
    {"prompt": "What light", "completion": " is that", "label": False},
    {"prompt": "O Romeo,", "completion": " wherefore art thou", "label": True},
    {"prompt": "Good night, sweet ", "completion": "king", "label": False},
    {"prompt": "Now is the winter", "completion": " of our discontent", "label": True},
    {"prompt": "All the world", "completion": " is round", "label": False},
    {"prompt": "Friends, Romans,", "completion": " countrymen", "label": True},
]
STEPS, LR, BETA = 3, 2e-3, 0.1
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")
LOGPS = ("logps/chosen", "logps/rejected")


def agree(mine: dict, theirs: dict, step: int, exact=REWARDS, close=LOGPS) -> None:
    """TRL's logged metrics: rewards (and `exact`) to 1e-5; the summed log-probs (about -50, a dozen tokens each)
    to 1e-4 relative, since our model's logits and transformers' differ by float32 rounding that the rewards'
    difference with the reference cancels and a sum over tokens accumulates."""
    for name in exact:
        assert abs(mine[name] - theirs[name]) <= 1e-5 * max(1.0, abs(theirs[name])), (step, name)
    for name in close:
        assert rel(mine[name], theirs[name]) < 1e-4, (step, name, mine[name], theirs[name])


@pytest.fixture(scope="module")
def setup(tiny_dataset, tmp_path_factory):
    """The HF model directory and the preprocessed pairs (no validation split)."""
    return preference_run_dir(tmp_path_factory.mktemp("pref"), tiny_dataset.parent / "tok", RECORDS, 0)


@pytest.fixture(scope="module")
def kto_setup(tiny_dataset, tmp_path_factory):
    """The HF model directory and the preprocessed KTO examples."""
    return preference_run_dir(tmp_path_factory.mktemp("kto"), tiny_dataset.parent / "tok", KTO_RECORDS, 0)


def ours(root, name: str, preference: dict, batch: int = len(RECORDS)) -> list[dict]:
    """metrics.jsonl of a meshformer run: full batch, STEPS steps, constant learning rate, clipping at 1."""
    extra = {
        "load_checkpoint": str(root / "hf"),
        "train_dataset.data_loader.type": "PreferenceDataset",
        **full_batch_overrides(batch, STEPS, LR),
        **{f"preference_config.{k}": v for k, v in preference.items()},
    }
    run_training(load_config(None, tiny_overrides(root / "data", root / name, extra)))
    return [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]


def trl_run(root, name: str, trainer: str, records=RECORDS, **args) -> tuple[list[float], list[dict]]:
    """TRL 1.16's per-step losses (as computed, unrounded) and logged metrics on the same model and records, in
    float32 (TRL's configs default to bf16 autocast, on a CPU too)."""
    import datasets
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32)
    # CPO and ORPO tokenize as TRL did before 1.0 and add the tokenizer's BOS, which DPOTrainer (and preprocess)
    # does not: the tiny tokenizer names <|endoftext|> as its BOS, so it is unset for them to see the same sequences.
    extra_tok = {"bos_token": None} if trainer in ("cpo", "orpo") else {}
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(root / "hf"), **extra_tok)
    common = {**trl_full_batch_args(root / name, len(records), STEPS, LR), "max_length": 33}
    if trainer == "dpo":
        config_cls, trainer_cls = trl.DPOConfig, trl.DPOTrainer
    elif trainer == "kto":
        config_cls, trainer_cls = trl.KTOConfig, trl.KTOTrainer
    elif trainer == "orpo":
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        config_cls, trainer_cls = ORPOConfig, ORPOTrainer
    else:
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        config_cls, trainer_cls = CPOConfig, CPOTrainer
    losses: list[float] = []

    class Recording(trainer_cls):
        def compute_loss(self, *a, **kw):
            out = super().compute_loss(*a, **kw)
            losses.append((out[0] if isinstance(out, tuple) else out).item())
            return out

    run = Recording(
        model=model, args=config_cls(**common, **args), train_dataset=datasets.Dataset.from_list(records),
        processing_class=tok,
    )  # fmt: skip
    run.train()
    logged = [h for h in run.state.log_history if "rewards/chosen" in h]
    return losses, logged


DPO_CASES = {
    "sigmoid": {"loss_type": "sigmoid"},
    "ipo": {"loss_type": "ipo"},
    "hinge": {"loss_type": "hinge"},
    "robust": {"loss_type": "robust", "label_smoothing": 0.1},
    "combined": {"loss_type": ["sigmoid", "bco_pair", "sft"], "loss_weights": [0.8, 0.2, 1.0]},
}


@pytest.mark.parametrize("case", list(DPO_CASES))
def test_dpo_steps_equal_trls(setup, case):
    pref = DPO_CASES[case]
    got = ours(setup, f"ours-{case}", {"method": "dpo", "beta": BETA, **pref})
    trl_args = {"beta": BETA, **pref}
    want_losses, want = trl_run(setup, f"trl-{case}", "dpo", **trl_args)
    assert len(got) == STEPS and len(want_losses) == STEPS
    for step, (mine, loss, theirs) in enumerate(zip(got, want_losses, want), start=1):
        assert rel(mine["loss"], loss) < 1e-5, (step, mine["loss"], loss)
        agree(mine, theirs, step)
    assert got[-1]["loss"] < got[0]["loss"]  # it learned: the comparison covers updated weights


def test_simpo_steps_equal_trls_cpo(setup):
    """SimPO is `trl.experimental.cpo`'s CPOTrainer with loss_type simpo and cpo_alpha 0 (no NLL term)."""
    got = ours(setup, "ours-simpo", {"method": "simpo", "beta": 2.0, "simpo_gamma": 0.5})
    want_losses, want = trl_run(setup, "trl-simpo", "cpo", loss_type="simpo", cpo_alpha=0.0, beta=2.0, simpo_gamma=0.5)
    assert len(got) == STEPS and len(want_losses) == STEPS
    for step, (mine, loss, theirs) in enumerate(zip(got, want_losses, want), start=1):
        assert rel(mine["loss"], loss) < 1e-5, (step, mine["loss"], loss)
        agree(mine, theirs, step)
    assert got[-1]["loss"] < got[0]["loss"]


def test_orpo_steps_equal_trls_orpo(setup):
    """ORPO is `trl.experimental.orpo`'s ORPOTrainer: the chosen rows' NLL over prompt and completion tokens plus
    beta x the log-sigmoid of the log odds ratio of per-token mean log-probs; its nll_loss and log odds agree."""
    got = ours(setup, "ours-orpo", {"method": "orpo", "beta": 0.5})
    want_losses, want = trl_run(setup, "trl-orpo", "orpo", beta=0.5)
    assert len(got) == STEPS and len(want_losses) == STEPS
    orpo_own = ("nll_loss", "log_odds_ratio", "log_odds_chosen")
    for step, (mine, loss, theirs) in enumerate(zip(got, want_losses, want), start=1):
        assert rel(mine["loss"], loss) < 1e-5, (step, mine["loss"], loss)
        agree(mine, theirs, step, REWARDS + orpo_own)
    assert got[-1]["loss"] < got[0]["loss"]


def test_kto_steps_equal_trls(kto_setup):
    """KTO is `trl.KTOTrainer`: unpaired examples against a frozen copy, with its KL estimate z0 from each prompt
    paired with the previous example's completion (the whole batch on one process: TRL's per-device batch), the
    desirable and undesirable weights; rewards, margins, kl and log-probs agree, and z0 moves off zero."""
    pref = {"beta": 0.5, "desirable_weight": 1.5, "undesirable_weight": 0.8}
    got = ours(kto_setup, "ours-kto", {"method": "kto", **pref}, batch=len(KTO_RECORDS))
    want_losses, want = trl_run(kto_setup, "trl-kto", "kto", records=KTO_RECORDS, **pref)
    assert len(got) == STEPS and len(want_losses) == STEPS
    exact = ("rewards/chosen", "rewards/rejected", "rewards/margins", "kl")
    for step, (mine, loss, theirs) in enumerate(zip(got, want_losses, want), start=1):
        assert rel(mine["loss"], loss) < 1e-5, (step, mine["loss"], loss)
        agree(mine, theirs, step, exact)
    assert got[0]["kl"] == 0.0 and any(m["kl"] > 0 for m in got)  # the KL term is exercised, not clamped away
    assert got[-1]["loss"] < got[0]["loss"]
