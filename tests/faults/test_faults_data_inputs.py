"""Data-input faults: damaged or absurd Megatron indexes, blends and splits, JSON records that are valid
JSON but no text, `data samples` ranges and splits, and data that trains no target. Each is one line naming the
field or file and the fix, exit code 2, before anything is built or trained, and changes no file."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import EMPTY, checksums, fails, tiny_overrides
from meshformer.data.megatron.indexed import HEADER_BYTES, IndexedWriter

SEQ = 16
FIELD = "train_dataset.data_loader"


@pytest.fixture
def watchdog():
    """Fail (not hang) a test whose refusal does not come: SIGALRM raises in the main thread after 120 s."""

    def expire(signum, frame):
        raise TimeoutError("not refused in time")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(120)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def megatron_dataset(prefix: Path, count: int = 50, seed: int = 0) -> str:
    """`count` documents of 5..60 tokens (below 500) ending in eod 1, as meshformer's writer writes them."""
    rng = np.random.default_rng(seed)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    with IndexedWriter(prefix, np.dtype(np.uint16)) as w:
        for _ in range(count):
            w.add_document(np.append(rng.integers(2, 500, int(rng.integers(5, 60))), 1))
        w.finalize()
    return str(prefix)


@pytest.fixture
def two(tmp_path) -> list[str]:
    return [megatron_dataset(tmp_path / "data" / f"d{k}_text_document", seed=k) for k in range(2)]


def blend_config(path: Path, data_path, split: str | None = "1,0,0", sizes=(100,), **config) -> Path:
    """A config whose training data is a BlendedMegatronDatasetDataLoader block (MindSpore Transformers' keys)."""
    cfg = {"seed": 1234, "eod": 1, "pad": -1, "data_path": data_path, **config}
    if split is not None:
        cfg["split"] = split
    section = {"data_loader": {"type": "BlendedMegatronDatasetDataLoader", "sizes": list(sizes), "config": cfg}}
    path.write_text(yaml.safe_dump({"train_dataset": section}))
    return path


def tiny(tmp_path: Path, extra: dict | None = None) -> list[str]:
    """The tiny model's overrides at seq_length 16, without a dataset_dir (the config names the data)."""
    argv = tiny_overrides(Path("unused"), tmp_path / "run", {"model.model_config.seq_length": SEQ, **(extra or {})})
    at = argv.index(f"--{FIELD}.dataset_dir")
    return argv[:at] + argv[at + 2 :]


def samples(capsys, tmp_path, config: Path, *needles, extra: list[str] = ()) -> str:
    return fails(capsys, ["data", "samples", str(config), "--json", *tiny(tmp_path), *extra], *needles)


# ---- Megatron indexes and blends ------------------------------------------------------------------------------


def test_an_index_pointing_beyond_the_bin_is_refused_when_opened(tmp_path, two, capsys):
    """Every pointer is checked when the index is opened, not only the last: sequence 10 pointing past the .bin is
    refused there, not met as an IndexError when read."""
    idx = Path(f"{two[0]}.idx")
    raw = bytearray(idx.read_bytes())
    at = HEADER_BYTES + 4 * 50 + 8 * 10  # sequence 10's int64 pointer
    raw[at : at + 8] = np.int64(10**9).tobytes()
    idx.write_bytes(bytes(raw))
    before = checksums(tmp_path / "data")
    config = blend_config(tmp_path / "c.yaml", ["0.5", two[0], "0.5", two[1]])
    for verb in ("samples", "stats"):
        fails(capsys, ["data", verb, str(config), *tiny(tmp_path)], f"{two[0]}.bin", "sequence 10", "re-create")
    fails(capsys, ["train", str(config), *tiny(tmp_path)], f"{two[0]}.bin", "sequence 10")
    assert checksums(tmp_path / "data") == before and not (tmp_path / "run").exists()


@pytest.mark.parametrize("weighted", [True, False])
def test_sizes_whose_indices_cannot_fit_are_refused_before_allocating(tmp_path, two, capsys, weighted, watchdog):
    data_path = ["0.5", two[0], "0.5", two[1]] if weighted else [two[0]]
    config = blend_config(tmp_path / "c.yaml", data_path, sizes=[10**11])
    started = time.monotonic()
    line = samples(capsys, tmp_path, config, f"{FIELD}.sizes[0]=100000000000", "bytes", "give at most about")
    assert time.monotonic() - started < 60, line
    assert "GiB" in line


@pytest.mark.parametrize("split", ["nan,0,0", "1,nan,0", "-1,2,0", "inf,1,0"])
def test_a_split_that_is_not_numbers_is_refused(tmp_path, two, capsys, split):
    """Megatron reads only the digits: '1,nan,0' would silently be [1, 0] and '-1,2,0' [1, 2]."""
    config = blend_config(tmp_path / "c.yaml", ["0.5", two[0], "0.5", two[1]], split=split)
    samples(capsys, tmp_path, config, f"{FIELD}.config.split", "is not a share")


def test_an_eod_outside_the_vocabulary_is_refused(tmp_path, two, capsys):
    config = blend_config(tmp_path / "c.yaml", [two[0]], eod=600)
    samples(capsys, tmp_path, config, f"{FIELD}.config.eod=600", "outside the vocabulary (512")
    fails(capsys, ["train", str(config), *tiny(tmp_path)], f"{FIELD}.config.eod=600")
    assert not (tmp_path / "run").exists()
    config = blend_config(tmp_path / "c.yaml", [two[0]], eod=-7)
    samples(capsys, tmp_path, config, f"{FIELD}.config.eod=-7", "-1 for none")


def test_blends_of_one_dataset_twice_or_of_mixed_tokenizers_are_refused(tmp_path, two, capsys):
    config = blend_config(tmp_path / "c.yaml", ["0.5", two[0], "0.5", two[0]])
    samples(capsys, tmp_path, config, f"{FIELD}.config.data_path", "listed twice")
    other = tmp_path / "data" / ".." / "data" / "d0_text_document"
    config = blend_config(tmp_path / "c.yaml", [two[0], str(other)], split="1,0,0")
    samples(capsys, tmp_path, config, "listed twice", "as ")
    third = megatron_dataset(tmp_path / "other" / "d2_text_document", seed=2)
    (tmp_path / "other" / "tokenizer.json").write_text("{}")
    config = blend_config(tmp_path / "c.yaml", ["0.5", two[0], "0.5", third])
    samples(capsys, tmp_path, config, "data/tokenizer.json is missing", "one tokenizer")


def test_a_blend_block_under_the_wrong_type_is_refused(tmp_path, two, tiny_dataset, capsys):
    """sizes and a Megatron config block under type MindDataset were silently ignored."""
    config = blend_config(tmp_path / "c.yaml", [two[0]])
    extra = [f"--{FIELD}.type", "MindDataset", f"--{FIELD}.dataset_dir", str(tiny_dataset)]
    samples(capsys, tmp_path, config, f"{FIELD}.sizes/config", "BlendedMegatronDatasetDataLoader", extra=extra)


def test_a_megatron_seed_beyond_numpy_is_refused(tmp_path, two, capsys):
    config = blend_config(tmp_path / "c.yaml", [two[0]], seed=2**40)
    samples(capsys, tmp_path, config, f"{FIELD}.config.seed", "4294967295")


# ---- preprocess: valid JSON that is no text --------------------------------------------------------------------


def preprocess(capsys, tmp_path, tiny_dataset, name: str, content: str, *needles):
    src = tmp_path / name
    src.write_text(content)
    out = tmp_path / "out"
    argv = ["preprocess", "--input", str(src), "--tokenizer", str(tiny_dataset.parent / "tok"), "--output", str(out)]
    fails(capsys, argv, *needles)
    assert not out.exists()


LONE = '"a \\ud800 b"'  # valid JSON: an escaped lone surrogate


@pytest.mark.parametrize(
    "name, content, where",
    [
        ("text.jsonl", f'{{"text": "fine"}}\n{{"text": {LONE}}}\n', "text.jsonl:2"),
        (
            "chat.jsonl",
            f'{{"messages": [{{"role": "user", "content": {LONE}}}, {{"role": "assistant", "content": "ok"}}]}}\n',
            "chat.jsonl:1",
        ),
        ("array.json", f'[{{"text": "fine"}}, {{"text": {LONE}}}]', "array.json[1]"),
    ],
)
def test_a_lone_surrogate_is_one_line_naming_the_record(tmp_path, tiny_dataset, capsys, name, content, where):
    preprocess(capsys, tmp_path, tiny_dataset, name, content, where, "\\ud800", "lone surrogate")


@pytest.mark.parametrize(
    "name, content, where",
    [
        ("deep.jsonl", '{"text": "x"}\n{"text": "y", "a": ' + "[" * 5000 + "]" * 5000 + "}\n", "deep.jsonl:2"),
        ("deep.json", "[" * 5000 + "]" * 5000, "deep.json[0]"),
        ("deepobj.json", '{"a": ' * 5000 + "1" + "}" * 5000, "deepobj.json"),
    ],
)
def test_json_nested_thousands_deep_is_one_line(tmp_path, tiny_dataset, capsys, name, content, where):
    preprocess(capsys, tmp_path, tiny_dataset, name, content, where, "nested too deeply")


def test_a_surrogate_pair_and_a_backslash_u_in_text_still_read(tmp_path, tiny_dataset):
    from meshformer.data.documents import iter_records

    src = tmp_path / "ok.jsonl"
    src.write_text('{"text": "pair \\ud83d\\ude00 C:\\\\udir"}\n')
    assert [r["text"] for _, _, r in iter_records(src)] == ["pair \U0001f600 C:\\udir"]


# ---- data samples ---------------------------------------------------------------------------------------------


def test_a_start_beyond_the_generators_range_is_refused(tmp_path, tiny_dataset, capsys):
    argv = ["data", "samples", EMPTY, *tiny_overrides(tiny_dataset, tmp_path / "run"), "--json"]
    fails(capsys, [*argv, "--start", str(2**80)], "--start 1208925819614629174706176", "2**63")
    fails(capsys, [*argv, "--start", str(2**63 - 1), "--count", "2"], "2**63")


def mindrecord_dir(root: Path, labels: bool = False, rows: int = 16) -> Path:
    from test_mindrecord import PRETRAIN, write

    g = np.random.default_rng(0)
    root.mkdir(parents=True)
    schema = dict(PRETRAIN, labels={"type": "int32", "shape": [-1]}) if labels else PRETRAIN
    data = []
    for _ in range(rows):
        row = {"input_ids": g.integers(1, 500, SEQ + 1).astype(np.int32)}
        if labels:
            row["labels"] = np.full(SEQ + 1, -100, np.int32)  # every label ignored
        data.append(row)
    write(root / "x.mindrecord", data, schema)
    return root


def test_validation_samples_of_mindrecords_without_a_split_are_refused(tmp_path, capsys):
    pytest.importorskip("mindspore")
    data = mindrecord_dir(tmp_path / "mr")
    argv = ["data", "samples", EMPTY, *tiny_overrides(data, tmp_path / "run", {"model.model_config.seq_length": SEQ})]
    fails(capsys, [*argv, "--json", "--split", "validation"], "no validation split", "eval_dataset.data_loader")


# ---- data that trains nothing ---------------------------------------------------------------------------------


def test_mindrecords_whose_labels_are_all_ignored_are_refused_at_start(tmp_path, capsys):
    pytest.importorskip("mindspore")
    data = mindrecord_dir(tmp_path / "mr", labels=True)
    before = checksums(data)
    argv = ["train", EMPTY, *tiny_overrides(data, tmp_path / "run", {"model.model_config.seq_length": SEQ})]
    fails(capsys, argv, f"{data / 'x.mindrecord'}", "no target is trained", "every label is ignored")
    assert checksums(data) == before and not (tmp_path / "run").exists()


def test_instruction_data_whose_loss_mask_is_all_zero_is_refused_at_start(tmp_path, tiny_dataset, capsys):
    from conftest import TURNS
    from meshformer.cli.main import main

    src = tmp_path / "chat.jsonl"
    src.write_text("".join(json.dumps({"messages": TURNS}) + "\n" for _ in range(12)))
    sft = tmp_path / "sft"
    argv = ["preprocess", "--input", str(src), "--tokenizer", str(tiny_dataset.parent / "tok"), "--output", str(sft)]
    assert main([*argv, "--template", "chatml"]) == 0
    mask = sft / "train.mask.bin"
    mask.write_bytes(bytes(len(mask.read_bytes())))
    before = checksums(sft)
    fails(capsys, ["train", EMPTY, *tiny_overrides(sft, tmp_path / "run")], str(sft), "no target is trained")
    assert checksums(sft) == before and not (tmp_path / "run").exists()
