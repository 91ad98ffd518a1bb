"""MindRecord files written by MindSpore's own FileWriter (several shards, several files, int32 and int64 columns)
read without MindSpore in `mindspore.dataset.MindDataset(files, shuffle=False)`'s order, token for token; fine-tuning
labels become MindSpore Transformers' loss mask; a MindRecord dataset_dir trains exactly as the same tokens in
meshformer's own format; damaged or foreign files are one line and exit 2, and reading changes no file."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import mindspore.dataset as msds
import numpy as np
import pytest
import torch
from mindspore.mindrecord import FileWriter

from conftest import EMPTY, checksums, fails, tiny_overrides
from meshformer.config.data_schema import DataLoaderConfig
from meshformer.data.dataset import PackedDataset, batch_inputs, open_dataset
from meshformer.data.mindrecord import MindRecordDataset, open_mindrecord
from meshformer.data.registry import open_dataset_for
from meshformer.errors import UserError

SEQ = 16
IGNORE = -100  # MindSpore Transformers' ignore_token_id, the value its preprocessing writes into labels
PRETRAIN = {"input_ids": {"type": "int32", "shape": [-1]}}


def write(path: Path, rows: list[dict], schema: dict, shards: int = 1, batches: int = 1, small: bool = True) -> None:
    """rows through MindSpore's FileWriter, in `batches` write_raw_data calls (each call spreads its rows over the
    shards); small pages unless `small` is false (then MindSpore's defaults: a 16 MB header, 32 MB pages)."""
    w = FileWriter(str(path), shard_num=shards, overwrite=True)
    if small:
        w.set_header_size(1 << 14)
        w.set_page_size(1 << 15)
    w.add_schema(schema, "meshformer test")
    for part in np.array_split(np.arange(len(rows)), batches):
        w.write_raw_data([rows[i] for i in part])
    w.commit()


def token_rows(n: int, seed: int, length: int = SEQ + 1, dtype=np.int32) -> list[dict]:
    """Ids of every compressed width (1, 2, 4 and, for int64, 8 bytes), the first one numbering the row."""
    g = np.random.default_rng(seed)
    top = 2**40 if dtype == np.int64 else 2**31 - 1
    rows = []
    for i in range(n):
        ids = g.choice([g.integers(0, 100), g.integers(0, 30000), g.integers(0, top)], size=length)
        ids[0] = seed * 1000 + i
        rows.append({"input_ids": ids.astype(dtype)})
    return rows


def minddataset(files, columns=("input_ids",)) -> list[dict]:
    """What MindSpore itself yields, in its order: `files` a list (those files) or one path (its whole set)."""
    ds = msds.MindDataset(files if isinstance(files, str) else [str(f) for f in files], list(columns), shuffle=False)
    return list(ds.create_dict_iterator(output_numpy=True, num_epochs=1))


def mindformers_files(root: Path) -> list[str]:
    """The list MindSpore Transformers hands MindDataset for a dataset_dir (CausalLanguageModelDataset
    ._process_mindrecord_data): files walked, names searched with r"mindrecord\\d*$", paths sorted."""
    found = [os.path.join(r, f) for r, _, fs in os.walk(root) for f in fs if re.findall(r"mindrecord\d*$", f)]
    return sorted(found)


def loader(**fields) -> DataLoaderConfig:
    return DataLoaderConfig(type="MindDataset", **{k: v if k != "dataset_dir" else str(v) for k, v in fields.items()})


def assert_same_tokens(ds, reference: list[dict], rows: int | None = None) -> None:
    """ds's samples are MindSpore's rows cut to seq_length + 1, all of them (or the first `rows`)."""
    assert len(ds) == len(reference)
    for i, row in enumerate(reference[:rows]):
        s = ds.sample(i)
        assert s.tokens.dtype == torch.int64 and torch.equal(s.tokens, torch.from_numpy(row["input_ids"][: SEQ + 1]))


@pytest.fixture(scope="module")
def pretraining_dir(tmp_path_factory) -> Path:
    """Two file sets and a lone file in a nested folder: 12 shards (names zero-padded: x.mindrecord00 ...), 3 shards,
    1 file; and a file the walk must skip."""
    root = tmp_path_factory.mktemp("pretrain")
    write(root / "web.mindrecord", token_rows(40, 1), PRETRAIN, shards=12, batches=3)
    write(root / "books.mindrecord", token_rows(9, 2), PRETRAIN, shards=3)
    (root / "more").mkdir()
    write(root / "more" / "code.mindrecord", token_rows(5, 3), PRETRAIN)
    (root / "notes.txt").write_text("not data")
    return root


def test_a_dataset_dir_reads_every_shard_in_minddatasets_order(pretraining_dir):
    files = mindformers_files(pretraining_dir)
    names = [
        *(f"books.mindrecord{k}" for k in range(3)),
        "code.mindrecord",
        *(f"web.mindrecord{k:02}" for k in range(12)),
    ]
    assert [Path(f).name for f in files] == names
    reference = minddataset(files)
    before = checksums(pretraining_dir)
    ds = open_dataset_for(loader(dataset_dir=pretraining_dir), "train", SEQ, "train_dataset.data_loader")
    assert isinstance(ds, MindRecordDataset)
    assert_same_tokens(ds, reference)
    assert ds.sample(0).loss_mask is None and ds.sample(0).documents is None  # no labels, no pad id: all targets
    assert (ds.tokenizer_hash, ds.vocab_size, ds.tokenizer_file) == (None, None, None)
    assert ds.state_dict()["format"] == "mindrecord" and ds.state_dict()["samples"] == 54
    stats = ds.describe()
    assert (stats["samples"], stats["tokens"], stats["files"], stats["rows_cut"]) == (54, 54 * (SEQ + 1), 16, 0)
    assert stats["columns"] == {"input_ids": "int32[-1]"}
    assert checksums(pretraining_dir) == before  # reading wrote nothing (no SQLite journal beside the index)


def test_dataset_files_are_read_in_the_order_listed(pretraining_dir):
    files = [pretraining_dir / "more" / "code.mindrecord", *sorted(pretraining_dir.glob("web.mindrecord*[0-9]"))[::-1]]
    ds = open_dataset_for(loader(dataset_files=[str(f) for f in files]), "train", SEQ, "train_dataset.data_loader")
    assert_same_tokens(ds, minddataset(files))


def test_a_dataset_dir_naming_one_shard_reads_its_whole_set(tmp_path):
    """As MindDataset given one file name; here in MindSpore's default layout (a 16 MB header, 32 MB pages)."""
    write(tmp_path / "books.mindrecord", token_rows(9, 2), PRETRAIN, shards=3, small=False)
    one = tmp_path / "books.mindrecord1"
    ds = open_dataset_for(loader(dataset_dir=one), "train", SEQ, "train_dataset.data_loader")
    assert_same_tokens(ds, minddataset(str(one)))
    assert len(ds) == 9


def test_int64_rows_longer_than_the_sequence_are_cut_and_shorter_ones_refused(tmp_path):
    schema = {"input_ids": {"type": "int64", "shape": [-1]}}
    rows = token_rows(6, 4, length=SEQ + 9, dtype=np.int64)
    rows[5] = {"input_ids": np.arange(SEQ, dtype=np.int64)}  # SEQ ids: one fewer than a sample needs
    write(tmp_path / "long.mindrecord", rows, schema, shards=2)
    files = [tmp_path / "long.mindrecord0", tmp_path / "long.mindrecord1"]
    reference = minddataset(files)
    assert reference[0]["input_ids"].dtype == np.int64 and int(reference[0]["input_ids"].max()) >= 2**31
    ds = open_mindrecord(files, SEQ, "train_dataset.data_loader")
    assert_same_tokens(ds, reference, rows=5)
    stats = ds.describe()
    assert (stats["rows_cut"], stats["rows_too_short"], stats["tokens_stored"]) == (5, 1, 5 * (SEQ + 9) + SEQ)
    with pytest.raises(UserError, match=rf"long.mindrecord1: row 2 has {SEQ} input_ids, fewer than seq_length \+ 1"):
        ds.sample(5)


def finetune_rows(n: int, seed: int, dtype=np.int32, pad: int = 0) -> list[dict]:
    """MindSpore Transformers' fine-tuning rows (llama_preprocess.py): a prompt and an answer, right-padded with
    `pad` to seq_length + 1; labels are input_ids with the prompt and the padding set to -100."""
    g = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        prompt, answer = int(g.integers(1, 6)), int(g.integers(1, 8))
        ids = np.full(SEQ + 1, pad, dtype=dtype)
        ids[: prompt + answer] = g.integers(1, 500, prompt + answer)
        labels = ids.copy()
        labels[:prompt] = IGNORE
        labels[prompt + answer :] = IGNORE
        rows.append({"input_ids": ids, "labels": labels})
    return rows


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_fine_tuning_labels_are_mindspore_transformers_loss_mask(tmp_path, dtype):
    kind = np.dtype(dtype).name
    schema = {"input_ids": {"type": kind, "shape": [-1]}, "labels": {"type": kind, "shape": [-1]}}
    write(tmp_path / "sft.mindrecord", finetune_rows(24, 5, dtype), schema, shards=2, batches=2)
    files = [tmp_path / "sft.mindrecord0", tmp_path / "sft.mindrecord1"]
    reference = minddataset(files, ("input_ids", "labels"))
    for pad in (None, 0):
        ds = open_mindrecord(files, SEQ, "train_dataset.data_loader", pad_token_id=pad)
        assert_same_tokens(ds, reference)
        for i, row in enumerate(reference):
            ids, labels = row["input_ids"].astype(np.int64), row["labels"].astype(np.int64)
            # LlamaForCausalLM.construct (training): tokens = input_ids[:, :-1], labels = labels[:, 1:],
            # input_mask = (tokens != pad_token_id) * (labels != ignore_token_id)
            keep = labels[1:] != IGNORE
            if pad is not None:
                keep &= ids[:-1] != pad
            inputs, trained, _ = batch_inputs([ds.sample(i)], 512, IGNORE, "test")
            assert torch.equal(inputs[0], torch.from_numpy(ids[:-1]))
            assert torch.equal(trained[0], torch.from_numpy(np.where(keep, ids[1:], IGNORE))), i
    assert ds.describe()["labels"] and ds.describe()["columns"]["labels"] == f"{kind}[-1]"


def test_the_pad_rule_drops_targets_whose_input_is_the_pad(tmp_path):
    rows = [{"input_ids": np.array([5, 7, 0, 9, 0, 0, 3] + [4] * (SEQ - 6), np.int32)}]
    write(tmp_path / "p.mindrecord", rows, PRETRAIN)
    s = open_mindrecord([tmp_path / "p.mindrecord"], SEQ, "x", pad_token_id=0).sample(0)
    want = np.ones(SEQ + 1, bool)
    want[[3, 5, 6]] = False  # the targets after each 0 input (MindSpore Transformers' tokens != pad_token_id)
    assert torch.equal(s.loss_mask, torch.from_numpy(want))


def test_labels_that_are_not_the_input_ids_are_refused(tmp_path):
    schema = {"input_ids": {"type": "int32", "shape": [-1]}, "labels": {"type": "int32", "shape": [-1]}}
    row = finetune_rows(1, 6)[0]
    shifted = {"input_ids": row["input_ids"], "labels": np.roll(row["input_ids"], -1)}
    write(tmp_path / "shifted.mindrecord", [shifted], schema)
    with pytest.raises(UserError, match=r"shifted.mindrecord: row 0: labels\[\d+\]=.* must be input_ids"):
        open_mindrecord([tmp_path / "shifted.mindrecord"], SEQ, "x").sample(0)


def test_meshformers_own_format_stays_the_mind_dataset_default(tiny_dataset):
    ds = open_dataset_for(loader(dataset_dir=tiny_dataset), "train", 32, "train_dataset.data_loader")
    assert isinstance(ds, PackedDataset)


def test_a_mindrecord_dir_trains_as_the_same_tokens_in_meshformers_format(tiny_dataset, tokenizer_dir, tmp_path):
    """The packed Shakespeare samples written as MindRecords (two files, two shards each) train the tiny model to
    the same losses, step for step, as the packed dataset itself: same samples, same order, same masks."""
    own = open_dataset(tiny_dataset, "train", 32, "train_dataset.data_loader.dataset_dir")
    rows = [{"input_ids": own.sample(i).tokens.numpy().astype(np.int32)} for i in range(len(own))]
    half = len(rows) // 2
    data = tmp_path / "mindrecord"
    data.mkdir()
    write(data / "part_a.mindrecord", rows[:half], PRETRAIN, shards=2)
    write(data / "part_b.mindrecord", rows[half:], PRETRAIN, shards=2)
    before = checksums(data)
    steps = {"runner_config.stop_step": 20}
    tok = ["--processor.tokenizer.tokenizer_file", str(tokenizer_dir / "tokenizer.json")]
    from meshformer.cli.main import main

    assert main(["train", EMPTY, *tiny_overrides(tiny_dataset, tmp_path / "own", steps)]) == 0
    assert main(["train", EMPTY, *tiny_overrides(data, tmp_path / "mr", steps), *tok]) == 0
    mr, base = (_losses(tmp_path / name) for name in ("mr", "own"))
    assert len(mr) == 20 and mr == base
    assert sum(mr[-3:]) / 3 < sum(mr[:3]) / 3 - 0.3, mr  # from ln(512) = 6.2: it learns
    assert checksums(data) == before


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _train_argv(data: Path | None, tmp_path: Path, files: list[Path] = ()) -> list[str]:
    """`meshformer train` of the tiny model on dataset_dir `data`, or on dataset_files `files`."""
    argv = tiny_overrides(data or tmp_path, tmp_path / "run", {"model.model_config.seq_length": SEQ})
    if data is None:
        at = argv.index("--train_dataset.data_loader.dataset_dir")
        del argv[at : at + 2]
        argv += ["--train_dataset.data_loader.dataset_files", "[" + ", ".join(map(str, files)) + "]"]
    return ["train", EMPTY, *argv]


def test_a_mindrecord_without_input_ids_is_one_line(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    schema = {"tokens": {"type": "int32", "shape": [-1]}, "label": {"type": "int32"}}
    write(data / "x.mindrecord", [{"tokens": np.arange(SEQ + 1, dtype=np.int32), "label": 1}], schema)
    fails(capsys, _train_argv(data, tmp_path), "x.mindrecord: no input_ids column", "label, tokens")


def test_damaged_shards_are_one_line_and_change_nothing(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    write(data / "x.mindrecord", token_rows(8, 7), PRETRAIN, shards=2)
    shard = data / "x.mindrecord1"
    whole = shard.read_bytes()
    shard.write_bytes(whole[: len(whole) - 40])
    before = checksums(data)
    fails(capsys, _train_argv(data, tmp_path), "x.mindrecord1: truncated")
    assert checksums(data) == before and not (tmp_path / "run").exists()
    shard.write_bytes(whole)
    os.rename(data / "x.mindrecord0.db", data / "x.db")
    fails(capsys, _train_argv(data, tmp_path), "x.mindrecord0.db is missing")
    os.rename(data / "x.db", data / "x.mindrecord0.db")
    shard.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00" + os.urandom(200))
    fails(capsys, _train_argv(data, tmp_path), "x.mindrecord1: not a MindRecord shard")
    schema = {"input_ids": {"type": "int32", "shape": [-1]}, "labels": {"type": "int32", "shape": [-1]}}
    write(tmp_path / "y.mindrecord", finetune_rows(2, 8), schema)
    files = [data / "x.mindrecord0", tmp_path / "y.mindrecord"]
    fails(capsys, _train_argv(None, tmp_path, files), "y.mindrecord has columns", "one schema and page size")
    fails(capsys, _train_argv(None, tmp_path, [data / "x.mindrecord7"]), "dataset_files", "x.mindrecord7 is not a file")


def test_validation_without_files_of_its_own_is_refused_and_with_them_runs(tmp_path, capsys):
    """MindRecords have no splits: validation on the training files would score training samples, so it needs
    files of its own."""
    from meshformer.cli.main import main

    g = np.random.default_rng(0)
    data = tmp_path / "mr"
    data.mkdir()
    write(
        data / "x.mindrecord",
        [{"input_ids": g.integers(0, 512, SEQ + 1).astype(np.int32)} for _ in range(16)],
        PRETRAIN,
    )
    argv = [*_train_argv(data, tmp_path), "--do_eval", "true", "--runner_config.stop_step", "2"]
    fails(capsys, argv, "no validation split", "eval_dataset.data_loader.dataset_dir")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    own = ["--eval_dataset.data_loader.dataset_dir", str(data), "--eval_config.eval_interval", "1"]
    assert main([*argv, *own]) == 0
    assert all(
        "eval_loss" in json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    )


def test_a_mindrecord_run_resumes_exactly(tmp_path, capsys):
    """Stopped at step 4 of 8 and resumed: the losses and gradient norms of an uninterrupted run (the sample order is
    a pure function of the seed and the step; the checkpoint proves the files are the same)."""
    from meshformer.cli.main import main

    g = np.random.default_rng(1)
    data = tmp_path / "mr"
    data.mkdir()
    rows = [{"input_ids": g.integers(0, 512, SEQ + 1).astype(np.int32)} for _ in range(48)]
    write(data / "x.mindrecord", rows, PRETRAIN, shards=2)
    ckpt = "[{type: CheckpointMonitor, save_checkpoint_steps: 2}]"

    def train(out: str, steps: int, *extra: str) -> list[tuple]:
        argv = _train_argv(data, tmp_path / out)
        argv += ["--runner_config.stop_step", str(steps), "--lr_schedule.total_steps", "8", "--callbacks", ckpt, *extra]
        assert main(argv) == 0, capsys.readouterr().err
        lines = (tmp_path / out / "run" / "metrics.jsonl").read_text().splitlines()
        return [(r["step"], r["loss"], r["grad_norm"]) for r in map(json.loads, lines)]

    full = train("full", 8)
    train("part", 4)
    assert train("part", 8, "--resume_training", "true") == full and len(full) == 8
