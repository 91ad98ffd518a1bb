"""A DPO run end to end through the trainer: it resumes exactly (the reference comes back at the starting weights,
from load_checkpoint), and validation reports TRL's metrics over the validation pairs (eval_rewards/..., the
preference eval_loss), and with LoRA `reference: adapter` trains as `reference: copy` does.

`reference: precomputed`: the log-probs computed once before step 1 give the run a frozen copy gives (training and
validation metrics within 1e-5), are stored with the run (safetensors, checksummed), are read back on a resume
instead of computed again (the resumed run equals the uninterrupted one exactly), and are refused in one line
(exit 2, the file kept) when the data is not the one they were computed on, or missing; under pipeline
parallelism (pp2, one 2-process launch) the run and its stored log-probs equal one process's."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from safetensors import safe_open

from conftest import EMPTY, LORA, ROOT, TORCHRUN, dpo_overrides, fails, preference_run_dir, torchrun_env
from meshformer.cli.train_cmd import run_training  # load_checkpoint: a Hugging Face directory
from meshformer.config import load_config
from meshformer.train import precomputed_reference

# three loss types (a per-pair term, a per-length term, a token mean) and validation every two steps
PRE = {
    "preference_config.loss_type": "[sigmoid, ipo, sft]",
    "preference_config.loss_weights": "[1.0, 0.5, 0.2]",
    "lr_schedule.total_steps": 4,
    "eval_config.eval_interval": 2,
}
WORDS = ["king", "queen", "night", "light", "sword", "crown", "storm", "rose"]
RECORDS = [
    {"prompt": f"The {a} and the", "chosen": f" {b} of the realm", "rejected": f" {c}"}
    for a, b, c in zip(WORDS, WORDS[1:] + WORDS[:1], WORDS[2:] + WORDS[:2])
]


@pytest.fixture(scope="module")
def setup(tiny_dataset, tmp_path_factory):
    return preference_run_dir(tmp_path_factory.mktemp("dpo"), tiny_dataset.parent / "tok", RECORDS, 0.25)


def overrides(root, out, extra: dict) -> list[str]:
    return dpo_overrides(
        root, out, {"preference_config.loss_type": "[sigmoid, sft]", "lr_schedule.total_steps": 6, **extra}
    )


def train(root, out, extra: dict) -> list[dict]:
    run_training(load_config(None, overrides(root, out, extra)))
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


KEYS = ("loss", "grad_norm", "rewards/chosen", "rewards/margins", "rewards/accuracies", "logps/chosen")


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 * max(1.0, abs(b))


def test_precomputed_equals_a_frozen_copy_and_resumes_without_recomputing(setup, tmp_path, monkeypatch):
    pre = {**PRE, "preference_config.reference": "precomputed"}
    copy = train(setup, tmp_path / "copy", {**PRE, "runner_config.stop_step": 4})
    full = train(setup, tmp_path / "full", {**pre, "runner_config.stop_step": 4})
    assert [r["step"] for r in full] == [1, 2, 3, 4]
    for a, b in zip(full, copy):
        for key in (*KEYS, *(f"eval_{k}" for k in KEYS[2:]), "eval_loss"):
            if key in b:
                assert close(a[key], b[key]), (a["step"], key, a[key], b[key])
    assert copy[-1]["rewards/margins"] != 0.0 and "eval_loss" in full[-1]  # the policy moved; validation ran

    stored = tmp_path / "full" / precomputed_reference.FILE
    with safe_open(str(stored), "pt") as f:
        assert set(f.keys()) == {"train", "validation"} and set(f.metadata()) == {"train", "validation"}
        assert f.get_tensor("train").shape[1] == 2 and bool((f.get_tensor("train") < 0).all())

    part = tmp_path / "part"
    train(setup, part, {**pre, "runner_config.stop_step": 2})

    def recompute(*args, **kwargs):
        raise AssertionError("a resumed run computed the reference again")

    monkeypatch.setattr(precomputed_reference, "compute_table", recompute)
    resumed = train(setup, part, {**pre, "runner_config.stop_step": 4, "resume_training": True, "load_checkpoint": ""})
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(full, resumed):
        for key in (*KEYS, "eval_loss", "eval_rewards/margins"):
            if key in a:
                assert a[key] == b[key], (a["step"], key, a[key], b[key])


def test_stored_log_probs_of_other_data_are_refused(setup, tmp_path, capsys):
    out = tmp_path / "run"
    pre = {**PRE, "preference_config.reference": "precomputed", "runner_config.stop_step": 2}
    train(setup, out, pre)
    stored = out / precomputed_reference.FILE
    with safe_open(str(stored), "pt") as f:
        tables, sums = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    sums["train"] = sums["train"].replace('"fingerprint": "', '"fingerprint": "0')  # as if computed on other pairs
    precomputed_reference.save_tables(out, tables, sums)
    before = stored.read_bytes()
    args = [
        "train",
        EMPTY,
        *overrides(setup, out, {**pre, "runner_config.stop_step": 3, "resume_training": True, "load_checkpoint": ""}),
    ]
    fails(capsys, args, "preference_config.reference=precomputed", "other train data", "new run")
    assert stored.read_bytes() == before  # nothing lost
    stored.unlink()
    fails(capsys, args, "preference_config.reference=precomputed", "is missing", "new run")


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


PIPELINE = {"train_dataset.batch_size": 1, "parallel_config.pipeline_stage": 2, "parallel_config.micro_batch_num": 2}


def test_precomputed_under_pipeline_parallelism_equals_one_process(setup, tmp_path):
    """`reference: precomputed` through the trainer at pp2 (1F1B: the one pass walks the stages forward-only, and
    rank 0, whose stage is not the last, saves the table), 2 pairs a step as one process's: every step's training
    and validation metrics and the stored table equal one process's within 1e-5."""
    pre = {**PRE, "preference_config.reference": "precomputed", "runner_config.stop_step": 4}
    want = train(setup, tmp_path / "one", pre)
    out = tmp_path / "pp2"
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "meshformer", "train", EMPTY]
    p = subprocess.run(
        [*cmd, *overrides(setup, out, {**pre, **PIPELINE})],
        capture_output=True, text=True, env=torchrun_env(), cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-5000:]
    got = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in got] == [1, 2, 3, 4] and "eval_loss" in got[-1]
    for a, b in zip(got, want):
        for key in (*KEYS, *(f"eval_{k}" for k in KEYS[2:]), "eval_loss"):
            if key in b:
                assert close(a[key], b[key]), (a["step"], key, a[key], b[key])
    tables = []
    for run in (out, tmp_path / "one"):
        with safe_open(str(run / precomputed_reference.FILE), "pt") as f:
            tables.append({k: f.get_tensor(k) for k in f.keys()})
    for split, table in tables[1].items():
        assert bool((table < 0).all()) and torch.allclose(tables[0][split], table, rtol=1e-5, atol=0), split
