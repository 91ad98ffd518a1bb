"""A preference run the step does not compute is refused in one line, exit 2, before anything is written:
an SFT term added to ORPO or KTO (TRL has none), `reference: precomputed` with KTO; and data of the other
kind: KTO on preference pairs, DPO or ORPO on unpaired KTO examples.

A DPO run killed with SIGKILL mid-training resumes exactly (tests/faults/test_resilience.py does it for SFT): with
`reference: copy` the reference comes back at the starting weights, with `reference: precomputed` its stored
log-probs are read back; every step's loss, gradient norm and TRL metrics equal an uninterrupted run's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import EMPTY, fails, tiny_overrides
from meshformer.cli.main import main

RECORDS = [{"prompt": f"Line {i}:", "chosen": " yes indeed", "rejected": " no"} for i in range(8)]


KTO_RECORDS = [{"prompt": f"Line {i}:", "completion": " yes indeed", "label": i % 2 == 0} for i in range(8)]


def _preprocessed(tiny_dataset, tmp_path_factory, records) -> object:
    root = tmp_path_factory.mktemp("pref")
    src = root / "records.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    tok = tiny_dataset.parent / "tok"
    assert main(["preprocess", "--input", str(src), "--tokenizer", str(tok), "--output", str(root / "data")]) == 0
    return root / "data"


@pytest.fixture(scope="module")
def pairs(tiny_dataset, tmp_path_factory):
    return _preprocessed(tiny_dataset, tmp_path_factory, RECORDS)


@pytest.fixture(scope="module")
def unpaired(tiny_dataset, tmp_path_factory):
    return _preprocessed(tiny_dataset, tmp_path_factory, KTO_RECORDS)


@pytest.mark.parametrize(
    "extra, needles",
    [
        (
            {"preference_config.method": "orpo", "preference_config.sft_weight": 0.5},
            ("preference_config.sft_weight=0.5", "orpo", "sft_weight: 0"),
        ),
        (
            {"preference_config.method": "kto", "preference_config.reference": "precomputed"},
            ("preference_config.reference=precomputed", "KL row", "copy or adapter"),
        ),
    ],
)
def test_what_the_step_does_not_compute_is_refused(pairs, tmp_path, capsys, extra, needles):
    out = tmp_path / "run"
    extra = {"train_dataset.data_loader.type": "PreferenceDataset", "runner_config.stop_step": 1, **extra}
    fails(capsys, ["train", EMPTY, *tiny_overrides(pairs, out, extra)], *needles)
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoint").exists()


STEPS = 12
EVERY_STEP = "[{type: CheckpointMonitor, save_checkpoint_steps: 1, keep_checkpoint_max: 2}]"
KEYS = ("step", "loss", "grad_norm", "rewards/chosen", "rewards/margins", "logps/rejected")


def _start(data: Path, out: Path, reference: str, log: Path) -> subprocess.Popen:
    extra = {
        "train_dataset.data_loader.type": "PreferenceDataset",
        "train_dataset.batch_size": 2,
        "preference_config.method": "dpo",
        "preference_config.reference": reference,
        "runner_config.stop_step": STEPS,
        "lr_schedule.total_steps": STEPS,
        "resume_training": "auto",
        "callbacks": EVERY_STEP,
    }
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "meshformer", "train", EMPTY, *tiny_overrides(data, out, extra)]
    with log.open("w") as stdout:
        return subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.PIPE, env=env, start_new_session=True)


def _records(out: Path) -> list[tuple]:
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [tuple(json.loads(ln)[k] for k in KEYS) for ln in lines if ln.endswith("}")]


@pytest.mark.parametrize("reference", ["copy", "precomputed"])
def test_dpo_resumes_exactly_after_sigkill(pairs, tmp_path, reference):
    whole = _start(pairs, tmp_path / "whole", reference, tmp_path / "whole.log")
    _, err = whole.communicate(timeout=300)
    assert whole.returncode == 0, err[-3000:]
    want = _records(tmp_path / "whole")
    assert len(want) == STEPS and want[-1][4] != 0.0  # the policy left the reference

    out = tmp_path / "killed"
    proc = _start(pairs, out, reference, tmp_path / "killed.log")
    t0 = time.time()
    while len(_records(out)) < 4 and proc.poll() is None and time.time() - t0 < 240:
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before the kill"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert len(_records(out)) < STEPS and any((out / "checkpoint").glob("step_*"))
    again = _start(pairs, out, reference, tmp_path / "again.log")
    _, err = again.communicate(timeout=300)
    assert again.returncode == 0, err[-3000:]
    log = (tmp_path / "again.log").read_text()
    assert "resumed from" in log  # not started over
    if reference == "precomputed":
        assert "reference log-probs read from" in log
    assert _records(out) == want


@pytest.mark.parametrize(
    "data, method, needles",
    [
        ("pairs", "kto", ("preference_config.method=kto", "holds preference pairs", "prompt/completion/label")),
        ("unpaired", "dpo", ("preference_config.method=dpo", "unpaired (KTO) examples", "method: kto")),
        ("unpaired", "orpo", ("preference_config.method=orpo", "unpaired (KTO) examples", "method: kto")),
    ],
)
def test_data_of_the_other_kind_is_refused(request, tmp_path, capsys, data, method, needles):
    """KTO takes unpaired examples, the pair methods pairs: one line naming the method and the fix, exit 2."""
    out = tmp_path / "run"
    extra = {"train_dataset.data_loader.type": "PreferenceDataset", "runner_config.stop_step": 1}
    extra["preference_config.method"] = method
    fails(capsys, ["train", EMPTY, *tiny_overrides(request.getfixturevalue(data), out, extra)], *needles)
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoint").exists()


def test_a_kto_batch_of_one_example_is_refused(unpaired, tmp_path, capsys):
    """KTO's KL row pairs a prompt with ANOTHER example's completion of the global batch: one example has none."""
    out = tmp_path / "run"
    extra = {"train_dataset.data_loader.type": "PreferenceDataset", "runner_config.stop_step": 1}
    extra |= {"preference_config.method": "kto", "train_dataset.batch_size": 1}
    fails(capsys, ["train", EMPTY, *tiny_overrides(unpaired, out, extra)], "train_dataset.batch_size=1", "KL term")
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoint").exists()
