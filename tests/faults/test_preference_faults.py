"""A preference run the step does not compute is refused in one line, exit 2, before anything is written:
`reference: precomputed`, an SFT term added to ORPO or KTO (TRL has none); and data of the other kind: KTO on
preference pairs, DPO or ORPO on unpaired KTO examples."""

from __future__ import annotations

import json

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
            {"preference_config.method": "dpo", "preference_config.reference": "precomputed"},
            ("reference=precomputed", "not built yet", "copy"),
        ),
    ],
)
def test_what_the_step_does_not_compute_is_refused(pairs, tmp_path, capsys, extra, needles):
    out = tmp_path / "run"
    extra = {"train_dataset.data_loader.type": "PreferenceDataset", "runner_config.stop_step": 1, **extra}
    fails(capsys, ["train", EMPTY, *tiny_overrides(pairs, out, extra)], *needles)
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoint").exists()


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
