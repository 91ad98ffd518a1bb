"""`meshformer data samples` prints what the trainer reads, in its order, and `data stats` the dataset's counts."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import EMPTY, TURNS, fails, tiny_overrides
from meshformer.cli.main import main
from meshformer.config import load_config
from meshformer.train.data import TrainingData
from meshformer.train.trainer import run_training


def _trained_batches(monkeypatch, overrides: list[str]) -> list[tuple]:
    """The (inputs, labels, documents) the trainer read, step by step, recorded from its data component."""
    seen, read = [], TrainingData.train_batch

    def recording(self, b):
        batch = read(self, b)
        seen.append(tuple(None if t is None else t.clone() for t in batch))
        return batch

    monkeypatch.setattr(TrainingData, "train_batch", recording)
    run_training(load_config(None, overrides))
    return seen


def _printed(capsys, argv: list[str]) -> list[dict]:
    capsys.readouterr()
    assert main(argv) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


@pytest.mark.parametrize("accumulation", [1, 2])
def test_samples_are_the_rows_the_trainer_reads_in_its_order(tiny_dataset, tmp_path, monkeypatch, capsys, accumulation):
    extra = {"runner_config.stop_step": 3, "runner_config.gradient_accumulation_steps": accumulation}
    overrides = tiny_overrides(tiny_dataset, tmp_path / "run", extra)
    batches = _trained_batches(monkeypatch, overrides)
    gb = 4 * accumulation
    rows = _printed(capsys, ["data", "samples", EMPTY, "--start", "0", "--count", str(3 * gb), "--json", *overrides])
    assert [r["step"] for r in rows] == [k // gb + 1 for k in range(3 * gb)] and len(batches) == 3
    for step, (inputs, labels, documents) in enumerate(batches):
        mine = rows[step * gb : (step + 1) * gb]
        assert documents is None and all("position_ids" not in r for r in mine)
        assert torch.equal(inputs, torch.tensor([r["tokens"] for r in mine]))
        assert torch.equal(labels, torch.tensor([r["labels"] for r in mine]))
    assert len({r["sample"] for r in rows}) == len(rows)  # shuffled ids, no repeats within an epoch
    assert [r["sample"] for r in rows] != sorted(r["sample"] for r in rows)
    later = _printed(capsys, ["data", "samples", EMPTY, "--start", "5", "--count", "2", "--json", *overrides])
    assert later == rows[5:7]


def test_packed_instruction_samples_show_the_mask_and_positions(tiny_dataset, tmp_path, monkeypatch, capsys):
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(json.dumps({"messages": TURNS[i % 2 :]}) + "\n" for i in range(40)))
    data = tmp_path / "sft"
    tok = tiny_dataset.parent / "tok"
    argv = ["preprocess", "--input", str(src), "--tokenizer", str(tok), "--output", str(data), "--val-fraction", "0"]
    assert main([*argv, "--template", "chatml", "--keep-duplicates"]) == 0
    extra = {
        "runner_config.stop_step": 2,
        "train_dataset.data_loader.packing": True,
        "model.model_config.seq_length": 96,
    }
    overrides = tiny_overrides(data, tmp_path / "run", extra)
    batches = _trained_batches(monkeypatch, overrides)
    rows = _printed(capsys, ["data", "samples", EMPTY, "--count", "8", "--json", *overrides])
    assert len(batches) == 2 and all(d is not None for _, _, d in batches)
    for step, (inputs, labels, documents) in enumerate(batches):
        mine = rows[step * 4 : (step + 1) * 4]
        assert torch.equal(inputs, torch.tensor([r["tokens"] for r in mine]))
        assert torch.equal(labels, torch.tensor([r["labels"] for r in mine]))
        for r, docs in zip(mine, documents.tolist()):
            assert r["loss_mask"] == [int(y != -100) for y in r["labels"]]
            starts = [i for i, d in enumerate(docs) if i == 0 or d != docs[i - 1]]
            assert [i for i, p in enumerate(r["position_ids"]) if p == 0] == starts
    assert 0 < sum(map(sum, (r["loss_mask"] for r in rows))) < sum(len(r["loss_mask"]) for r in rows)
    capsys.readouterr()
    assert main(["data", "samples", EMPTY, "--count", "1", *overrides]) == 0
    assert "<|im_start|>" in capsys.readouterr().out  # decoded text, special tokens shown


def test_stats_count_the_dataset(tiny_dataset, tmp_path, capsys):
    overrides = tiny_overrides(tiny_dataset, tmp_path / "run")
    meta = json.loads((tiny_dataset / "meta.json").read_text())
    capsys.readouterr()
    assert main(["data", "stats", EMPTY, "--json", *overrides]) == 0
    stats = json.loads(capsys.readouterr().out)
    tokens = meta["splits"]["train"]["tokens"]
    assert stats["tokens"] == tokens and stats["documents"] == meta["splits"]["train"]["documents"]
    assert stats["samples"] == (tokens - 1) // 32 and stats["steps_per_epoch"] == stats["samples"] // 4
    assert stats["tokens_unused"] == tokens - (stats["samples"] * 32 + 1)


def test_bad_arguments_are_one_line(tiny_dataset, tmp_path, capsys):
    overrides = tiny_overrides(tiny_dataset, tmp_path / "run")
    fails(capsys, ["data", "samples", EMPTY, "--count", "0", *overrides], "--count")
    empty_dir = ["--train_dataset.data_loader.dataset_dir", str(tmp_path)]
    fails(capsys, ["data", "stats", EMPTY, *overrides, *empty_dir], "dataset_dir", "meshformer preprocess")
