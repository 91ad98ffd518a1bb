"""A DPO run end to end through the trainer: it resumes exactly (the reference comes back at the starting weights,
from load_checkpoint), and validation reports TRL's metrics over the validation pairs (eval_rewards/..., the
preference eval_loss), and with LoRA `reference: adapter` trains as `reference: copy` does."""

from __future__ import annotations

import json

import pytest

from conftest import LORA, preference_run_dir, tiny_overrides
from meshformer.cli.train_cmd import run_training  # load_checkpoint: a Hugging Face directory
from meshformer.config import load_config

WORDS = ["king", "queen", "night", "light", "sword", "crown", "storm", "rose"]
RECORDS = [
    {"prompt": f"The {a} and the", "chosen": f" {b} of the realm", "rejected": f" {c}"}
    for a, b, c in zip(WORDS, WORDS[1:] + WORDS[:1], WORDS[2:] + WORDS[:2])
]


@pytest.fixture(scope="module")
def setup(tiny_dataset, tmp_path_factory):
    return preference_run_dir(tmp_path_factory.mktemp("dpo"), tiny_dataset.parent / "tok", RECORDS, 0.25)


def train(root, out, extra: dict) -> list[dict]:
    extra = {
        "load_checkpoint": str(root / "hf"),
        "train_dataset.data_loader.type": "PreferenceDataset",
        "train_dataset.batch_size": 2,
        "model.model_config.rms_norm_eps": 1e-5,
        "preference_config.method": "dpo",
        "preference_config.loss_type": "[sigmoid, sft]",
        "lr_schedule.total_steps": 6,
        **extra,
    }
    run_training(load_config(None, tiny_overrides(root / "data", out, extra)))
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_dpo_resumes_exactly(setup, tmp_path):
    full = train(setup, tmp_path / "full", {"runner_config.stop_step": 6})
    part = tmp_path / "part"
    train(setup, part, {"runner_config.stop_step": 3})
    resume = {"runner_config.stop_step": 6, "resume_training": True, "load_checkpoint": ""}  # from the run itself
    resumed = train(setup, part, resume)
    assert [r["step"] for r in resumed] == list(range(1, 7))
    for a, b in zip(full, resumed):
        for key in ("loss", "grad_norm", "rewards/margins", "rewards/accuracies", "logps/chosen"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
    assert full[0]["rewards/margins"] == 0.0 and full[-1]["rewards/margins"] != 0.0  # the reference stayed put


def test_validation_reports_trls_metrics(setup, tmp_path):
    recs = train(setup, tmp_path / "run", {"runner_config.stop_step": 4, "eval_config.eval_interval": 2})
    evaluated = [r for r in recs if "eval_loss" in r]
    assert [r["step"] for r in evaluated] == [2, 4]
    for r in evaluated:
        margins = r["eval_rewards/chosen"] - r["eval_rewards/rejected"]
        assert abs(r["eval_rewards/margins"] - margins) < 1e-6 and 0 <= r["eval_rewards/accuracies"] <= 1
        assert r["eval_logps/chosen"] < 0 and r["eval_loss"] > 0
    assert evaluated[0]["eval_rewards/margins"] != 0.0  # after two steps the policy left the reference


def test_lora_adapter_reference_equals_a_frozen_copy(setup, tmp_path):
    """`reference: adapter` (the policy with its adapters off, no second model) gives the run `reference: copy`
    gives: both are the starting weights, since LoRA's B starts at zero."""
    lora = {**LORA, "runner_config.stop_step": 3, "optimizer.learning_rate": 1e-2}
    adapter = train(setup, tmp_path / "adapter", {**lora, "preference_config.reference": "adapter"})
    copy = train(setup, tmp_path / "copy", {**lora, "preference_config.reference": "copy"})
    for a, b in zip(adapter, copy):
        for key in ("loss", "grad_norm", "rewards/margins", "logps/chosen"):
            assert abs(a[key] - b[key]) <= 1e-6 * max(1.0, abs(b[key])), (a["step"], key, a[key], b[key])
    assert adapter[-1]["rewards/margins"] != 0.0  # the adapters moved the policy away from the reference


KTO_RECORDS = [
    {"prompt": f"The {a} and the", "completion": f" {b} of the realm" if i % 3 else f" {b}", "label": i % 2 == 0}
    for i, (a, b) in enumerate(zip(WORDS, WORDS[1:] + WORDS[:1]))
]


def test_kto_resumes_exactly_and_validates(tiny_dataset, tmp_path):
    """KTO end to end on shuffled unpaired examples (its KL rows: each prompt with the previous example's
    completion of the global batch, over two epochs): a resumed run equals the uninterrupted one, and validation
    reports TRL's KTO metrics (eval_kl, eval_rewards/...)."""
    root = preference_run_dir(tmp_path / "kto", tiny_dataset.parent / "tok", KTO_RECORDS, 0.25)
    kto = {"preference_config.method": "kto", "preference_config.loss_type": "kto", "preference_config.beta": 0.5}
    kto |= {"train_dataset.data_loader.shuffle": True, "eval_config.eval_interval": 3}
    full = train(root, tmp_path / "full", {**kto, "runner_config.stop_step": 6})
    train(root, tmp_path / "part", {**kto, "runner_config.stop_step": 3})
    resume = {**kto, "runner_config.stop_step": 6, "resume_training": True, "load_checkpoint": ""}
    resumed = train(root, tmp_path / "part", resume)
    assert [r["step"] for r in resumed] == list(range(1, 7))
    for a, b in zip(full, resumed):
        for key in ("loss", "grad_norm", "kl", "logps/chosen", "logps/rejected"):
            assert a.get(key) == b.get(key), (a["step"], key, a.get(key), b.get(key))
    evaluated = [r for r in full if "eval_loss" in r]
    assert [r["step"] for r in evaluated] == [3, 6]
    for r in evaluated:
        assert r["eval_kl"] >= 0 and {"eval_rewards/chosen", "eval_rewards/rejected"} & set(r)  # those it holds
    assert full[0]["kl"] == 0.0 and full[0]["rewards/chosen"] == 0.0  # the policy starts as the reference
