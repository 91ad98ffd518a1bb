"""Megatron indexed datasets and MindSpore Transformers' BlendedMegatronDatasetDataLoader, against megatron-core
0.16.1 in the same process: files either side writes are read token for token by the other; blends, single
datasets over several epochs and train/validation splits give Megatron's samples in Megatron's order (every token,
label, loss mask and position id); a blend trains and resumes exactly; bad data is one line and exit code 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

from conftest import CORPUS, fails, tiny_overrides
from meshformer.config import load_config
from meshformer.data.megatron.indexed import IndexedFile, IndexedWriter
from meshformer.data.registry import open_dataset_for
from meshformer.data.tokenizer import load_tokenizer, special_token_ids, tokenizer_hash
from meshformer.errors import UserError

EOD, SEQ, SEED = 1, 16, 1234
FIELD = "train_dataset.data_loader"


class MegatronTokenizer:
    """What megatron-core's GPTDataset asks of a tokenizer."""

    def __init__(self, eod: int, pad: int):
        self.eod, self.pad, self.vocab_size = eod, pad, 512
        self.unique_identifiers = {"class": "MegatronTokenizer", "eod": eod, "pad": pad}


def random_documents(seed: int, count: int, max_len: int = 60) -> list[np.ndarray]:
    """Documents of 1..max_len tokens ending in EOD; token 0 (a pad id in some tests) appears now and then."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(count):
        body = rng.integers(2, 500, int(rng.integers(0, max_len)))
        body[rng.random(len(body)) < 0.03] = 0
        docs.append(np.append(body, EOD))
    return docs


def megatron_write(prefix: Path, docs: list[np.ndarray], dtype=np.uint16) -> str:
    """PREFIX.bin/.idx written by megatron-core's IndexedDatasetBuilder, one sequence per document."""
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for d in docs:
        builder.add_item(torch.from_numpy(d.astype(np.int64)))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


@pytest.fixture
def three(tmp_path) -> list[str]:
    """Three datasets of different sizes, written by megatron-core."""
    return [
        megatron_write(tmp_path / f"part{k}_text_document", random_documents(k, n)) for k, n in enumerate((60, 90, 35))
    ]


def megatron_split(prefixes, weights, split, sizes, which, **settings):
    """Megatron's own dataset for split `which` (0 train, 1 validation)."""
    eod, pad = settings.pop("eod", EOD), settings.pop("pad", -1)
    flags = {k: settings.pop(k, False) for k in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")}
    config = GPTDatasetConfig(
        random_seed=settings.pop("seed", SEED),
        sequence_length=SEQ,
        blend=(prefixes, weights),
        split=split,
        tokenizer=MegatronTokenizer(eod, pad),
        path_to_cache=None,  # Megatron then caches beside the prefixes, inside tmp_path
        **flags,
        # Megatron builds a seq x seq mask per sample in Python: only where a test compares it
        create_attention_mask=settings.pop("create_attention_mask", False),
        **settings,
    )
    return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()[which]


def block(data_path: list, split: str | None, sizes: list, **config) -> dict:
    """The train_dataset section of a MindSpore Transformers config (its pre-training template's keys)."""
    cfg = {"seed": SEED, "seq_length": SEQ, "eod": EOD, "pad": -1, "data_path": data_path, **config}
    if split is not None:
        cfg["split"] = split
    return {
        "data_loader": {
            "type": "BlendedMegatronDatasetDataLoader",
            "datasets_type": "GPTDataset",
            "sizes": sizes,
            "config": cfg,
        },
        "input_columns": ["input_ids", "labels", "loss_mask", "position_ids", "attention_mask"],
        "construct_args_key": ["input_ids", "labels", "loss_mask", "position_ids", "attention_mask"],
        "num_parallel_workers": 8,
        "python_multiprocessing": False,
        "numa_enable": False,
        "seed": SEED,
    }


def write_config(path: Path, train_dataset: dict, **sections) -> Path:
    path.write_text(yaml.safe_dump({"train_dataset": train_dataset, **sections}))
    return path


def ours(tmp_path: Path, train_dataset: dict, split: str = "train", name: str = "mf.yaml"):
    cfg = load_config(write_config(tmp_path / name, train_dataset), ["--model.model_config.seq_length", str(SEQ)])
    return open_dataset_for(cfg.train_dataset.data_loader, split, SEQ, FIELD)


def weighted(weights, prefixes) -> list:
    return [x for w, p in zip(weights, prefixes) for x in (str(w), p)]


def positions(documents: torch.Tensor) -> torch.Tensor:
    """Rotary positions restarting at each document, as meshformer derives them from `documents`."""
    n = len(documents)
    starts = torch.cat([torch.tensor([True]), documents[1:] != documents[:-1]])
    first = torch.cummax(torch.where(starts, torch.arange(n), 0), 0).values
    return torch.arange(n) - first


def assert_same_samples(ds, ref, count: int | None = None) -> None:
    """Sample i of ours is Megatron's sample i: inputs, labels, loss mask, position ids (and attention masks)."""
    assert len(ds) == len(ref) > 0
    n = len(ref) if count is None else min(count, len(ref))
    for i in range(n):
        want, got = ref[i], ds.sample(i)
        assert torch.equal(got.tokens[:-1], want["tokens"]), i
        assert torch.equal(got.tokens[1:], want["labels"]), i
        assert torch.equal(got.loss_mask[1:], want["loss_mask"].bool()), i
        if got.documents is None:
            assert torch.equal(want["position_ids"], torch.arange(SEQ)), i
            continue
        assert torch.equal(positions(got.documents)[:-1], want["position_ids"]), i
        if "attention_mask" in want:  # meshformer's attention: causal within a document
            d = got.documents[:-1]
            allowed = torch.tril(torch.ones(SEQ, SEQ, dtype=torch.bool)) & (d[:, None] == d[None, :])
            assert torch.equal(want["attention_mask"][0], ~allowed), i


# ---- indexed files ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_files_megatron_writes_read_token_for_token(tmp_path, dtype):
    docs = random_documents(3, 50)
    if dtype == np.int32:
        docs[7][0] = 1_000_000  # beyond uint16
    builder = IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=dtype)
    for d in docs[:40]:
        builder.add_item(torch.from_numpy(d.astype(np.int64)))
        builder.end_document()
    builder.add_item(torch.from_numpy(docs[40].astype(np.int64)))  # a document of several sequences
    builder.add_item(torch.from_numpy(docs[41].astype(np.int64)))
    builder.end_document()
    builder.finalize(str(tmp_path / "m.idx"))
    ref, got = IndexedDataset(str(tmp_path / "m")), IndexedFile(tmp_path / "m")
    assert got.dtype == np.dtype(dtype) and len(got) == len(ref) == 42
    assert np.array_equal(got.document_indices, ref.document_indices)
    assert np.array_equal(got.sequence_lengths, ref.sequence_lengths)
    for i in range(len(ref)):
        assert np.array_equal(got.get(i), ref[i]), i
        assert np.array_equal(got.get(i, 1, 3), ref.get(i, 1, 3)), i
    assert isinstance(got.get(0), np.memmap)  # a view into the mapped .bin, not a copy


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_files_meshformer_writes_are_read_by_megatron(tmp_path, dtype):
    docs = random_documents(4, 45)
    if dtype == np.int32:
        docs[3][0] = 70_000
    with IndexedWriter(tmp_path / "ours", np.dtype(dtype)) as w:
        for d in docs:
            w.add_document(d)
        counts = w.finalize()
    assert counts == {"tokens": sum(map(len, docs)), "documents": len(docs)}
    ref = IndexedDataset(str(tmp_path / "ours"))
    assert len(ref) == len(docs) and list(ref.document_indices) == list(range(len(docs) + 1))
    for i, d in enumerate(docs):
        assert np.array_equal(ref[i], d.astype(dtype)), i
    # byte for byte what megatron-core's own builder writes
    megatron_write(tmp_path / "theirs", docs, dtype)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"ours{suffix}").read_bytes() == (tmp_path / f"theirs{suffix}").read_bytes(), suffix


def test_the_writer_overwrites_nothing_and_leaves_nothing_behind_a_failure(tmp_path):
    megatron_write(tmp_path / "done", random_documents(0, 5))
    before = (tmp_path / "done.bin").read_bytes()
    with pytest.raises(UserError, match="already exists"):
        IndexedWriter(tmp_path / "done", np.dtype(np.uint16))
    assert (tmp_path / "done.bin").read_bytes() == before
    with pytest.raises(UserError, match="does not fit uint16"):
        with IndexedWriter(tmp_path / "wide", np.dtype(np.uint16)) as w:
            w.add_document(np.array([5, 70_000]))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("wide")) == []


# ---- sample order against megatron-core ------------------------------------------------------------------------

MASKS = {"eod_mask_loss": True, "reset_position_ids": True, "reset_attention_mask": True}


@pytest.mark.parametrize(
    "settings",
    [
        {},  # the template's defaults: every target counts, one document per row
        # eod targets masked, documents restart at eod (attention too), pad tokens in the data masked
        {**MASKS, "pad": 0, "create_attention_mask": True},
        {"add_extra_token_to_sequence": False, "seed": 7},
    ],
    ids=["plain", "eod-masks-pad", "no-extra-token"],
)
def test_a_three_way_blend_gives_megatrons_samples_in_order(tmp_path, three, settings):
    weights = [0.5, 0.3, 0.2]
    ds = ours(tmp_path, block(weighted(weights, three), "1, 0, 0", [400, 0, 0], **settings))
    assert ds.ordered and ds.tokenizer_hash is None and ds.vocab_size is None and ds.tokenizer_file is None
    ref = megatron_split(three, weights, "1, 0, 0", [400, 0, 0], 0, **settings)
    assert_same_samples(ds, ref)  # every one of the 400-odd samples
    stats = ds.describe()
    assert sum(stats["samples_per_dataset"]) == len(ds)
    assert stats["blend_proportions"] == pytest.approx(weights, abs=0.01)
    assert stats["documents"] == 60 + 90 + 35
    state = ds.state_dict()
    assert state["format"] == "megatron-blend" and state["blend"]["prefixes"] == three
    json.dumps(state)


def test_numeric_weights_and_relative_prefixes_are_megatrons_too(tmp_path, three, monkeypatch):
    monkeypatch.chdir(tmp_path)
    names = [Path(p).name for p in three]
    ds = ours(tmp_path, block([3, names[0], 1, names[2]], "1,0,0", [100]))
    ref = megatron_split([names[0], names[2]], [3.0, 1.0], "1,0,0", [100, 0, 0], 0)
    assert_same_samples(ds, ref)


@pytest.mark.parametrize("size", [700, 1100], ids=["final-epoch-apart", "final-epoch-shuffled-with-the-rest"])
def test_a_single_dataset_over_several_epochs(tmp_path, size):
    # 120 documents, 223 samples an epoch: 700 takes 31 of the 4th (< 80%: shuffled on its own), 1100 208 of the 5th
    prefix = megatron_write(tmp_path / "one_text_document", random_documents(5, 120))
    ds = ours(tmp_path, block([prefix], "1,0,0", [size, 0, 0], **MASKS))
    ref = megatron_split([prefix], None, "1,0,0", [size, 0, 0], 0, **MASKS)
    assert ref.num_samples == size and len(ref) > 3 * 225
    assert_same_samples(ds, ref)
    assert ds.describe()["datasets"][0]["epochs"] > 3


def test_train_and_validation_of_a_90_10_0_split(tmp_path, three):
    weights = [0.2, 0.5, 0.3]
    sizes = [300, 40, 0]
    section = block(weighted(weights, three), "90,10,0", sizes, **MASKS)
    for split, which in (("train", 0), ("validation", 1)):
        ref = megatron_split(three, weights, "90,10,0", sizes, which, **MASKS)
        assert_same_samples(ours(tmp_path, section, split), ref)
    # the last partial validation sample kept (padded) rather than dropped
    keep = {**MASKS, "drop_last_partial_validation_sequence": False}
    ref = megatron_split([three[1]], None, "90,10,0", [None, None, None], 1, **keep)
    got = ours(tmp_path, block([three[1]], "90,10,0", [], **keep), "validation")
    dropped = ours(tmp_path, block([three[1]], "90,10,0", [], **MASKS), "validation")
    assert len(got) == len(dropped) + 1
    assert_same_samples(got, ref)


def test_validation_without_a_size_is_one_epoch_of_each_dataset(tmp_path, three):
    # weights: as many samples as one epoch of every dataset's validation split, drawn by the weights
    weights = [0.5, 0.3, 0.2]
    ds = ours(tmp_path, block(weighted(weights, three), "80,20,0", [100, 0, 0]), "validation")
    epoch = [len(megatron_split([p], None, "80,20,0", [None] * 3, 1)) for p in three]
    ref = megatron_split(three, weights, "80,20,0", [100, sum(epoch), 0], 1)
    assert_same_samples(ds, ref)
    # no weights: Megatron's exhaustive blend, every dataset once, in proportion to its size
    ds = ours(tmp_path, block(three, "80,20,0", []), "validation")
    ref = megatron_split(three, None, "80,20,0", [None] * 3, 1)
    assert_same_samples(ds, ref)
    assert ds.describe()["samples_per_dataset"] == epoch


def test_blends_per_split(tmp_path, three):
    weights = [0.6, 0.4]
    config = {
        "train_data_path": weighted(weights, three[:2]),
        "valid_data_path": [three[2]],
    }
    section = block([], None, [200, 30, 0], **config)
    section["data_loader"]["config"].pop("data_path")
    config_ref = GPTDatasetConfig(
        random_seed=SEED,
        sequence_length=SEQ,
        blend_per_split=[(three[:2], weights), ([three[2]], None), None],
        tokenizer=MegatronTokenizer(EOD, -1),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache=None,
    )
    refs = BlendedMegatronDatasetBuilder(GPTDataset, [200, 30, 0], lambda: True, config_ref).build()
    assert_same_samples(ours(tmp_path, section), refs[0])
    assert_same_samples(ours(tmp_path, section, "validation"), refs[1])


def test_a_million_documents_build_in_seconds(tmp_path):
    import struct
    import time

    n, rng = 1_000_000, np.random.default_rng(1)
    lengths = rng.integers(1, 40, n).astype(np.int32)
    tokens = rng.integers(2, 60_000, int(lengths.sum())).astype(np.uint16)
    prefix = tmp_path / "big_text_document"
    tokens.tofile(f"{prefix}.bin")  # the .idx by hand (megatron's builder takes a minute for this many)
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1].astype(np.int64) * 2)])
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, n, n + 1) + lengths.tobytes())
        f.write(pointers.tobytes() + np.arange(n + 1, dtype=np.int64).tobytes())
    start = time.perf_counter()
    ds = ours(tmp_path, block(["1", str(prefix)], "99,1,0", [50_000, 0, 0]))
    seconds = time.perf_counter() - start
    ref = megatron_split([str(prefix)], [1.0], "99,1,0", [50_000, 0, 0], 0)
    assert len(ds) == len(ref)
    for i in (0, 1, 777, 31_000, len(ref) - 1):
        want = ref[i]
        assert torch.equal(ds.sample(i).tokens[:-1], want["tokens"]), i
    assert seconds < 30, seconds  # about 1 s on a 2-core Xeon; Megatron's C++ takes about as long


# ---- training -------------------------------------------------------------------------------------------------


@pytest.fixture
def shakespeare_blend(tmp_path, tokenizer_dir) -> list[str]:
    """Two plays' paragraphs, tokenized with the tiny tokenizer, in three Megatron datasets with it beside them."""
    tok = load_tokenizer(tokenizer_dir)
    eos = special_token_ids(tok, tokenizer_dir)["eos"]
    paragraphs = [p for f in CORPUS[:2] for p in f.read_text().split("\n\n") if p.strip()]
    prefixes = []
    for k in range(3):
        folder = tmp_path / f"corpus{k}"
        folder.mkdir()
        shutil.copy(tokenizer_dir / "tokenizer.json", folder / "tokenizer.json")
        with IndexedWriter(folder / "text_document", np.dtype(np.uint16)) as w:
            for p in paragraphs[k::3]:
                w.add_document(np.array(tok.encode(p).ids + [eos]))
            w.finalize()
        prefixes.append(str(folder / "text_document"))
    return prefixes


def test_a_blend_trains_and_resumes_exactly_mid_epoch(tmp_path, shakespeare_blend, tokenizer_dir, capsys):
    from meshformer.cli.main import main

    eos = special_token_ids(load_tokenizer(tokenizer_dir), tokenizer_dir)["eos"]
    section = block(weighted([0.5, 0.3, 0.2], shakespeare_blend), "1,0,0", [400, 0, 0], **MASKS, eod=eos)
    section["data_loader"]["config"]["seq_length"] = 32
    config = write_config(tmp_path / "blend.yaml", section)
    ckpt = "[{type: CheckpointMonitor, save_checkpoint_steps: 4}]"

    def train(out: Path, steps: int, **extra) -> list[dict]:
        argv = tiny_overrides(Path("unused"), out, {"runner_config.stop_step": steps, "callbacks": ckpt, **extra})
        assert main(["train", str(config), *argv]) == 0, capsys.readouterr().err
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    long = train(tmp_path / "long", 30)
    start, end = (sum(r["loss"] for r in recs) / 3 for recs in (long[:3], long[-3:]))
    assert end < start - 0.5, (start, end)
    saved = tmp_path / "long" / "checkpoint" / "step_00000030" / "tokenizer.json"
    assert tokenizer_hash(saved) == tokenizer_hash(tokenizer_dir)  # the tokenizer beside the data came along

    common = {"lr_schedule.total_steps": 10}
    full = train(tmp_path / "full", 10, **common)
    train(tmp_path / "part", 6, **common)  # 24 of 400 samples: mid-epoch
    resumed = train(tmp_path / "part", 10, resume_training=True, **common)
    assert [r["step"] for r in resumed] == list(range(1, 11))
    assert [(r["loss"], r["grad_norm"]) for r in full] == [(r["loss"], r["grad_norm"]) for r in resumed]


# ---- bad input ------------------------------------------------------------------------------------------------


def refuse(capsys, tmp_path: Path, section: dict, *needles: str, extra: dict | None = None) -> str:
    config = write_config(tmp_path / "bad.yaml", section)
    argv = tiny_overrides(Path("unused"), tmp_path / "run", {"model.model_config.seq_length": SEQ, **(extra or {})})
    return fails(capsys, ["train", str(config), *argv], *needles)


def test_bad_data_is_one_line_and_exit_2(tmp_path, three, capsys):
    good = ["0.5", three[0], "0.5", three[1]]
    data_path = f"{FIELD}.config.data_path"
    for entries, needle in (
        (["0.5", three[0], three[1]], "odd number"),
        (["x", three[0], "0.5", three[1]], "not a number"),
        (["-1", three[0], "2", three[1]], "positive"),
        (["0", three[0], "0", three[1]], "positive"),
        (["0.5", three[0], "0.5", 0.25], "not a dataset prefix"),
        (["1", str(tmp_path / "missing")], "missing.idx: no such file"),
    ):
        refuse(capsys, tmp_path, block(entries, "1,0,0", [100]), data_path, needle)
    refuse(capsys, tmp_path, block([], "1,0,0", [100]), data_path, "empty")
    refuse(capsys, tmp_path, block(good, "1,0,0", [100, "x"]), f"{FIELD}.sizes")
    refuse(capsys, tmp_path, block(good, "a,b", [100]), f"{FIELD}.config.split")
    refuse(capsys, tmp_path, block(good, None, [100]), f"{FIELD}.config.split")
    refuse(capsys, tmp_path, block(good, "1,0,0", [100], seq_length=8), "seq_length=8", "seq_length=16")
    refuse(capsys, tmp_path, block(good, "1,0,0", [100], reset_attention_mask=True), "set both or neither")
    refuse(capsys, tmp_path, block(good, "1,0,0", [100], eod=-1, eod_mask_loss=True), "config.eod")
    refuse(capsys, tmp_path, block(good, "1,0,0", [100]), "no share", extra={"do_eval": True})
    # damaged files, by name
    broken = tmp_path / "broken_text_document"
    for suffix in (".bin", ".idx"):
        shutil.copy(f"{three[0]}{suffix}", f"{broken}{suffix}")
    idx = Path(f"{broken}.idx")
    idx.write_bytes(idx.read_bytes()[:-40])
    refuse(capsys, tmp_path, block(["1", str(broken)], "1,0,0", [100]), data_path, f"{idx}: truncated")
    shutil.copy(f"{three[0]}.idx", idx)
    bin_ = Path(f"{broken}.bin")
    bin_.write_bytes(bin_.read_bytes()[:-10])
    refuse(capsys, tmp_path, block(["1", str(broken)], "1,0,0", [100]), f"{bin_}: truncated")
    idx.write_bytes(b"MMIDIDX\x00\x01" + idx.read_bytes()[9:])
    refuse(capsys, tmp_path, block(["1", str(broken)], "1,0,0", [100]), "not a Megatron index")


def test_an_eval_section_with_its_own_blend_is_read(tmp_path, shakespeare_blend, tokenizer_dir, capsys):
    """eval_dataset's own BlendedMegatronDatasetDataLoader block is the validation data (not the training block's
    validation share): two eval blends give the same training losses and different validation losses."""
    from meshformer.cli.main import main

    eos = special_token_ids(load_tokenizer(tokenizer_dir), tokenizer_dir)["eos"]
    train_block = block(weighted([0.5, 0.5], shakespeare_blend[:2]), "1,0,0", [200, 0, 0], eod=eos, seq_length=32)
    runs = []
    for k, prefix in enumerate(shakespeare_blend[1:]):
        evals = block([prefix], "1,0,0", [16, 0, 0], eod=eos, seq_length=32)
        config = tmp_path / f"eval{k}.yaml"
        config.write_text(yaml.safe_dump({"train_dataset": train_block, "eval_dataset": evals, "do_eval": True}))
        extra = {"runner_config.stop_step": 2, "eval_config.eval_interval": 1, "eval_dataset.split": "train"}
        argv = tiny_overrides(Path("unused"), tmp_path / f"run{k}", extra)
        assert main(["train", str(config), *argv]) == 0, capsys.readouterr().err
        runs.append([json.loads(line) for line in (tmp_path / f"run{k}" / "metrics.jsonl").read_text().splitlines()])
    assert [r["loss"] for r in runs[0]] == [r["loss"] for r in runs[1]]
    assert all("eval_loss" in r for run in runs for r in run)
    assert runs[0][0]["eval_loss"] != runs[1][0]["eval_loss"]
