"""A preference run the step does not compute yet is refused in one line, exit 2, before anything is written:
ORPO (its loss exists, the step does not feed it; KTO alike)."""

from __future__ import annotations

import json

import pytest

from conftest import EMPTY, fails, tiny_overrides
from meshformer.cli.main import main

RECORDS = [{"prompt": f"Line {i}:", "chosen": " yes indeed", "rejected": " no"} for i in range(8)]


@pytest.fixture(scope="module")
def pairs(tiny_dataset, tmp_path_factory):
    root = tmp_path_factory.mktemp("pairs")
    src = root / "pairs.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    tok = tiny_dataset.parent / "tok"
    assert main(["preprocess", "--input", str(src), "--tokenizer", str(tok), "--output", str(root / "data")]) == 0
    return root / "data"


@pytest.mark.parametrize(
    "extra, needles",
    [
        ({"preference_config.method": "orpo"}, ("preference_config.method=orpo", "not built yet", "dpo or simpo")),
    ],
)
def test_what_the_step_does_not_compute_is_refused(pairs, tmp_path, capsys, extra, needles):
    out = tmp_path / "run"
    extra = {"train_dataset.data_loader.type": "PreferenceDataset", "runner_config.stop_step": 1, **extra}
    fails(capsys, ["train", EMPTY, *tiny_overrides(pairs, out, extra)], *needles)
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoint").exists()
