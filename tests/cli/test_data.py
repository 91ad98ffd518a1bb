"""Tokenizer training, preprocessing into the packed format, and reading it back (data/*.py, CLI)."""

from __future__ import annotations

import hashlib
import io
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console
from tokenizers import Tokenizer, models, pre_tokenizers

from meshformer.cli.main import main as cli_main
from meshformer.data import dataset
from meshformer.data.dataset import GlobalBatches, PackedDataset, SampleOrder
from meshformer.data.preprocess import FORMAT, preprocess
from meshformer.data.tokenizer import SPECIAL_TOKENS, load_tokenizer, special_token_ids, tokenizer_hash, train_tokenizer
from meshformer.errors import UserError

WORDS = (
    "thou",
    "art",
    "king",
    "queen",
    "sword",
    "crown",
    "murder",
    "night",
    "morrow",
    "sweet",
    "ghost",
    "father",
    "mother",
    "castle",
    "forest",
    "storm",
    "island",
    "letter",
    "poison",
    "dagger",
    "honest",
    "noble",
    "villain",
    "fool",
    "madness",
    "lady",
    "lord",
    "speak",
    "swear",
    "weep",
    "laugh",
    "dream",
    "sleep",
    "wake",
    "love",
    "hate",
    "blood",
    "heaven",
    "earth",
    "grave",
    "wherefore",
    "alas",
    "prithee",
    "marry",
    "forsooth",
)
QUIET = dict(console=Console(file=io.StringIO()))


def make_docs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        lines = [
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))).capitalize() + rng.choice(".!?,;")
            for _ in range(rng.randint(2, 6))
        ]
        docs.append(f"ACT {i}\n" + "\n".join(lines) + "\n")
    return docs


def write_jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[Path]:
    d = tmp_path_factory.mktemp("corpus")
    files = []
    for k, doc_group in enumerate((make_docs(40, 1), make_docs(40, 2))):
        f = d / f"play{k}.txt"
        f.write_text("\n\n".join(doc_group), encoding="utf-8")
        files.append(f)
    return files


@pytest.fixture(scope="module")
def tok_dir(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer([str(f) for f in corpus], 400, out)
    return out


def encode(tok: Tokenizer, text: str) -> list[int]:
    """The reference: what preprocess must store for one document (before its EOS)."""
    tok.encode_special_tokens = True
    return tok.encode(text, add_special_tokens=False).ids


# ---------------------------------------------------------------- tokenizer


def test_trained_tokenizer_vocab_specials_and_hash(tok_dir):
    tok = load_tokenizer(tok_dir)
    assert tok.get_vocab_size() == 400  # the corpus supports the full vocabulary asked for
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert special_token_ids(tok, tok_dir) == {"bos": 0, "eos": 0, "pad": 1}
    f = tok_dir / "tokenizer.json"
    assert tokenizer_hash(tok_dir) == tokenizer_hash(f) == hashlib.sha256(f.read_bytes()).hexdigest()
    assert load_tokenizer(f).to_str() == tok.to_str()


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!",
        "  leading spaces and trailing  ",
        "tabs\tand\r\nCRLF\n\n\nblank lines",
        "",
        "Ünïcödé ñ — “quotes” 中文字符 日本語 한국어 🎭🗡️👑 e\u0301 (combining)",
        "\x00\x01 control \x7f bytes",
        "never seen: Zyzzyva quixotic 0123456789 {}[]<>",
        "<|endoftext|> literal <|im_start|> specials",
    ],
)
def test_round_trip_any_text(tok_dir, text):
    tok = load_tokenizer(tok_dir)
    ids = encode(tok, text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert 0 not in ids  # a literal "<|endoftext|>" in text stays text, never a document boundary


def test_train_tokenizer_refuses_overwrite_and_bad_size(corpus, tmp_path):
    train_tokenizer([str(corpus[0])], 300, tmp_path)
    before = (tmp_path / "tokenizer.json").read_bytes()
    with pytest.raises(UserError, match="--overwrite"):
        train_tokenizer([str(corpus[0])], 320, tmp_path)
    assert (tmp_path / "tokenizer.json").read_bytes() == before
    train_tokenizer([str(corpus[0])], 320, tmp_path, overwrite=True)
    assert load_tokenizer(tmp_path).get_vocab_size() == 320
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": 3}\n')
    with pytest.raises(UserError, match=r"bad\.jsonl:2: field 'text' is int, not a string"):
        train_tokenizer([str(bad)], 300, tmp_path / "y")
    assert not (tmp_path / "y").exists()
    with pytest.raises(UserError, match="--vocab-size=100"):
        train_tokenizer([str(corpus[0])], 100, tmp_path / "x")


def test_load_tokenizer_missing_or_corrupt(tmp_path):
    with pytest.raises(UserError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(UserError, match="not a valid tokenizer.json"):
        load_tokenizer(tmp_path)


def _word_tokenizer(tokens: list[str]) -> Tokenizer:
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token=tokens[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def test_special_token_ids_of_foreign_tokenizers(tmp_path):
    llama2 = _word_tokenizer(["<unk>", "<s>", "</s>", "a"])
    assert special_token_ids(llama2) == {"bos": 1, "eos": 2, "pad": 2}
    qwen = _word_tokenizer(["a", "<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert special_token_ids(qwen) == {"bos": 1, "eos": 1, "pad": 1}  # document end, not chat-turn end
    llama3 = _word_tokenizer(["a", "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|finetune_right_pad_id|>"])
    assert special_token_ids(llama3) == {"bos": 1, "eos": 2, "pad": 4}
    # An explicit tokenizer_config.json (AddedToken dict form) beats the name guess.
    llama3.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|eot_id|>"}}))
    assert special_token_ids(llama3, tmp_path)["eos"] == 3
    with pytest.raises(UserError, match="no end-of-text token"):
        special_token_ids(_word_tokenizer(["<unk>", "a", "b"]))


# ---------------------------------------------------------------- preprocess


def read_docs(out: Path, split: str, eos: int) -> list[list[int]]:
    """Split a stream back into documents with the .idx.npy offsets, checking every one ends in EOS."""
    meta = json.loads((out / "meta.json").read_text())
    toks = np.fromfile(out / f"{split}.bin", dtype=np.dtype(meta["dtype"]).newbyteorder("<")).tolist()
    idx = np.load(out / f"{split}.idx.npy", allow_pickle=False)
    assert idx.dtype == np.int64 and len(idx) == meta["splits"][split]["documents"]
    assert len(toks) == meta["splits"][split]["tokens"]
    bounds = list(idx) + [len(toks)]
    docs = [toks[a:b] for a, b in zip(bounds, bounds[1:])]
    assert all(d[-1] == eos and eos not in d[:-1] for d in docs)
    return [d[:-1] for d in docs]


def test_preprocess_document_split_matches_reference(tok_dir, tmp_path, monkeypatch):
    monkeypatch.setattr("meshformer.data.preprocess.BATCH_DOCS", 7)  # many encode_batch calls, a ragged last one
    docs = make_docs(400, seed=7) + ["a document quoting <|endoftext|> mid-text"]
    out = tmp_path / "ds"
    s = preprocess([write_jsonl(tmp_path / "c.jsonl", docs)], tok_dir, out, val_fraction=0.05, **QUIET)
    tok = load_tokenizer(tok_dir)
    ref = {d: encode(tok, d) for d in docs}
    train, val = read_docs(out, "train", 0), read_docs(out, "validation", 0)
    decoded = [tok.decode(d, skip_special_tokens=False) for d in train + val]
    assert sorted(decoded) == sorted(docs)  # every document exactly once over the two splits: disjoint, complete
    assert all(ref[tok.decode(d, skip_special_tokens=False)] == d for d in train + val)
    assert s["split_mode"] == "document" and 5 <= len(val) <= 40  # ~20 expected of 401
    # Input order inside a split is kept, and the split depends on content only, not on order.
    assert decoded[: len(train)] == [d for d in docs if d in set(decoded[: len(train)])]
    out2 = tmp_path / "ds2"
    preprocess([write_jsonl(tmp_path / "r.jsonl", docs[::-1])], tok_dir, out2, val_fraction=0.05, **QUIET)
    assert sorted(map(tuple, read_docs(out2, "validation", 0))) == sorted(map(tuple, val))
    # The reader sees the same stream: windows of seq_length + 1 with stride seq_length.
    ds = PackedDataset(out, "train", seq_length=16)
    stream = [t for d in train for t in d + [0]]
    assert len(ds) == (len(stream) - 1) // 16
    assert ds[3].tolist() == stream[48:65]


def test_preprocess_few_documents_carves_each_tail(tok_dir, corpus, tmp_path):
    out = tmp_path / "ds"
    s = preprocess(corpus, tok_dir, out, val_fraction=0.1, **QUIET)
    tok = load_tokenizer(tok_dir)
    train, val = read_docs(out, "train", 0), read_docs(out, "validation", 0)
    assert s["split_mode"] == "tail" and len(train) == len(val) == 2
    for f, tr, va in zip(corpus, train, val):
        full = encode(tok, f.read_text(encoding="utf-8"))
        assert tr + va == full and len(va) == math.ceil(0.1 * len(full))  # disjoint, nothing lost
    assert s["splits"]["validation"]["tokens"] > 0


def test_split_blank_lines(tok_dir, corpus, tmp_path):
    s = preprocess([corpus[0]], tok_dir, tmp_path / "ds", val_fraction=0, split_blank_lines=True, **QUIET)
    assert s["empty_documents_skipped"] == 0 and s["documents_read"] == 40
    tok = load_tokenizer(tok_dir)
    assert read_docs(tmp_path / "ds", "train", 0) == [encode(tok, d.strip()) for d in make_docs(40, 1)]


def test_duplicates_counted_dropped_or_kept(tok_dir, tmp_path):
    docs = make_docs(6, seed=3)
    dup = docs + [docs[0], "  " + docs[1].strip() + "\n\n", docs[0], "   \n"]  # 3 duplicates, 1 empty
    f = write_jsonl(tmp_path / "d.jsonl", dup)
    buf = io.StringIO()
    s = preprocess([f], tok_dir, tmp_path / "a", val_fraction=0.0, console=Console(file=buf))
    assert (s["duplicates_found"], s["duplicates_removed"], s["empty_documents_skipped"]) == (3, 3, 1)
    assert s["splits"]["train"]["documents"] == 6 and s["splits"]["validation"]["tokens"] == 0
    assert "3 exact duplicate document(s) found: 3 dropped" in buf.getvalue()
    tok = load_tokenizer(tok_dir)
    assert read_docs(tmp_path / "a", "train", 0) == [encode(tok, d) for d in docs]
    k = preprocess([f], tok_dir, tmp_path / "b", val_fraction=0.0, keep_duplicates=True, **QUIET)
    assert (k["duplicates_found"], k["duplicates_removed"], k["splits"]["train"]["documents"]) == (3, 0, 9)
    assert json.loads((tmp_path / "b" / "meta.json").read_text())["duplicates_removed"] == 0


def test_dtype_uint16_then_uint32(tok_dir, tmp_path):
    s = preprocess([write_jsonl(tmp_path / "a.jsonl", make_docs(3))], tok_dir, tmp_path / "a", **QUIET)
    assert s["dtype"] == "uint16"
    assert (tmp_path / "a" / "train.bin").stat().st_size == 2 * s["splits"]["train"]["tokens"]
    big = _word_tokenizer(["<unk>", "<|endoftext|>"] + [f"w{i}" for i in range(2, 70_000)])
    big.save(str(tmp_path / "big.json"))
    f = write_jsonl(tmp_path / "b.jsonl", ["w2 w69999 w65536"])
    s = preprocess([f], tmp_path / "big.json", tmp_path / "b", val_fraction=0, **QUIET)
    assert s["dtype"] == "uint32" and s["vocab_size"] == 70_000
    assert read_docs(tmp_path / "b", "train", 1) == [[2, 69999, 65536]]


def test_bad_inputs_are_user_errors(tok_dir, tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"text": "fine"}\n\n{"text": "broken\n')
    with pytest.raises(UserError, match=r"bad\.jsonl:3: not valid JSON"):
        preprocess([f], tok_dir, tmp_path / "o", **QUIET)
    f.write_text('{"body": "x"}\n')
    with pytest.raises(UserError, match=r"bad\.jsonl:1: no 'text' field \(fields: body\)"):
        preprocess([f], tok_dir, tmp_path / "o", **QUIET)
    assert preprocess([f], tok_dir, tmp_path / "o", text_field="body", val_fraction=0, **QUIET)["splits"]
    (tmp_path / "x.csv").write_text("a,b\n")
    (tmp_path / "empty.txt").write_text(" \n")
    for inputs, msg in [
        ([tmp_path / "x.csv"], "unsupported suffix"),
        ([tmp_path / "nope.txt"], "does not exist"),
        ([], "no input files"),
        ([tmp_path / "empty.txt"], "no text in"),
    ]:
        with pytest.raises(UserError, match=msg):
            preprocess(inputs, tok_dir, tmp_path / "p", **QUIET)
    with pytest.raises(UserError, match="--val-fraction"):
        preprocess([f], tok_dir, tmp_path / "p", val_fraction=1.0, **QUIET)
    # Failed runs leave neither the output nor a temp directory behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "empty.txt", "o", "x.csv"]


def test_refuses_overwrite_and_failed_overwrite_keeps_old(tok_dir, tmp_path):
    f = write_jsonl(tmp_path / "a.jsonl", make_docs(3))
    out = tmp_path / "ds"
    out.mkdir()
    preprocess([f], tok_dir, out, **QUIET)  # an existing empty directory is fine
    old_meta = (out / "meta.json").read_bytes()
    with pytest.raises(UserError, match="--overwrite"):
        preprocess([f], tok_dir, out, **QUIET)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("[1]\n")
    with pytest.raises(UserError, match="not an object"):
        preprocess([bad], tok_dir, out, overwrite=True, **QUIET)
    assert (out / "meta.json").read_bytes() == old_meta
    (out / "notes.txt").write_text("x")  # something the user put there: --overwrite must not delete it
    with pytest.raises(UserError, match=r"not a dataset written by `meshformer preprocess` \(notes.txt\)"):
        preprocess([f], tok_dir, out, overwrite=True, **QUIET)
    assert (out / "notes.txt").read_text() == "x" and (out / "meta.json").read_bytes() == old_meta
    (out / "notes.txt").unlink()
    preprocess([f], tok_dir, out, overwrite=True, val_fraction=0.5, **QUIET)
    assert json.loads((out / "meta.json").read_text())["val_fraction"] == 0.5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "bad.jsonl", "ds"]


def test_meta_and_tokenizer_hash_check(tok_dir, corpus, tmp_path):
    assert FORMAT == dataset.FORMAT
    out = tmp_path / "ds"
    preprocess(corpus, tok_dir, out, **QUIET)
    meta = json.loads((out / "meta.json").read_text())
    assert (out / "tokenizer.json").read_bytes() == (tok_dir / "tokenizer.json").read_bytes()
    assert (meta["format"], meta["vocab_size"], meta["eos_token_id"]) == (FORMAT, 400, 0)
    ds = PackedDataset(out, "validation", seq_length=8)
    ds.check_tokenizer(tokenizer_hash(tok_dir), 512, "tokenizer")
    other = tmp_path / "tok2"
    train_tokenizer([str(corpus[1])], 300, other)
    with pytest.raises(UserError, match="different tokenizer"):
        ds.check_tokenizer(tokenizer_hash(other), 512, "tokenizer")
    with pytest.raises(UserError, match="vocab_size >= 400"):
        ds.check_tokenizer(tokenizer_hash(tok_dir), 256, "tokenizer")


# ---------------------------------------------------------------- CLI


def test_cli_in_process(corpus, tmp_path, capsys):
    assert (
        cli_main(
            [
                "tokenizer",
                "train",
                "--input",
                *map(str, corpus),
                "--vocab-size",
                "300",
                "--output",
                str(tmp_path / "tok"),
            ]
        )
        == 0
    )
    assert (
        cli_main(
            [
                "preprocess",
                "--input",
                *map(str, corpus),
                "--tokenizer",
                str(tmp_path / "tok"),
                "--output",
                str(tmp_path / "ds"),
                "--val-fraction",
                "0.05",
            ]
        )
        == 0
    )
    assert json.loads((tmp_path / "ds" / "meta.json").read_text())["vocab_size"] == 300
    capsys.readouterr()
    assert (
        cli_main(
            ["tokenizer", "train", "--input", str(corpus[0]), "--vocab-size", "300", "--output", str(tmp_path / "tok")]
        )
        == 2
    )
    assert "already holds a tokenizer.json" in capsys.readouterr().err


def test_cli_subprocess_error_is_one_line(corpus, tok_dir, tmp_path):
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "x").write_text("keep me")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshformer",
            "preprocess",
            "--input",
            str(corpus[0]),
            "--tokenizer",
            str(tok_dir),
            "--output",
            str(tmp_path / "ds"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("meshformer: error: --output=")
    assert "Traceback" not in r.stderr and (tmp_path / "ds" / "x").read_text() == "keep me"


# ---------------------------------------------------------------- sample order (dataset.py)


def test_sample_order_epoch_covers_every_sample_once():
    n, gb = 48, 8
    order = SampleOrder(n, seed=5, shuffle=True)
    batches = GlobalBatches(order, gb)
    for epoch in range(2):
        ids = [int(i) for b in range(epoch * 6, epoch * 6 + 6) for i in batches.sample_ids(b)]
        assert sorted(ids) == list(range(n))
    assert batches.sample_ids(0).tolist() != batches.sample_ids(6).tolist()  # epochs reshuffle
    assert GlobalBatches(SampleOrder(n, 0, shuffle=False), gb).sample_ids(7).tolist() == list(range(8, 16))
    # drop_remainder: 50 samples, batches of 8 -> 6 batches of distinct samples, then epoch 1
    tail = GlobalBatches(SampleOrder(50, 5, True), gb)
    assert tail.per_epoch == 6 and len({int(i) for b in range(6) for i in tail.sample_ids(b)}) == 48


@pytest.mark.parametrize("dp", [2, 4])
def test_dp_ranks_disjoint_union_is_global_batch(dp):
    order = SampleOrder(40, seed=11, shuffle=True)
    full = GlobalBatches(order, 8)
    for b in (0, 3, 9):
        parts = [GlobalBatches(order, 8, r, dp).sample_ids(b).tolist() for r in range(dp)]
        assert all(len(p) == 8 // dp for p in parts)
        assert sum(parts, []) == full.sample_ids(b).tolist()  # disjoint and, in rank order, the global batch


def test_order_depends_only_on_seed():
    a = GlobalBatches(SampleOrder(30, seed=3, shuffle=True), 6)
    seq = [a.sample_ids(b).tolist() for b in range(12)]
    # A fresh object jumping straight to batch 9 (a resumed run) sees the same samples.
    assert GlobalBatches(SampleOrder(30, seed=3, shuffle=True), 6).sample_ids(9).tolist() == seq[9]
    assert [GlobalBatches(SampleOrder(30, 3, True), 6).sample_ids(b).tolist() for b in range(12)] == seq
    assert [GlobalBatches(SampleOrder(30, 4, True), 6).sample_ids(b).tolist() for b in range(12)] != seq
