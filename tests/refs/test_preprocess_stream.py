"""Streaming `preprocess` (data/sources.py, token_stream.py, packed_writer.py, preprocess_scan.py,
preprocess_resume.py): every input format gives the tokens the tokenizer gives the text, long documents are
encoded in pieces that equal the whole, batches are bounded by the chunk size, dedup and split decisions follow the
content-hash rule, a killed run resumes to identical bytes, --format megatron is read by megatron-core."""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset
from rich.console import Console
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

from conftest import CORPUS, fails
from meshformer.cli.main import main
from meshformer.data import documents, preprocess_scan, token_stream
from meshformer.data.preprocess import preprocess
from meshformer.data.seen_hashes import SeenHashes
from meshformer.data.token_stream import Encoder, batches, cut_safe, document_units
from meshformer.data.tokenizer import load_tokenizer, train_tokenizer

QUIET = dict(console=Console(file=io.StringIO()))
SHAKESPEARE = "".join(p.read_text(encoding="utf-8") for p in CORPUS[:2])
LLAMA3_SPLIT = token_stream._LETTERS + r"\p{N}{1,3}" + token_stream._SPACES


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer([str(p) for p in CORPUS[:2]], 600, out)
    return out


def encode(tok_dir: Path, text: str) -> list[int]:
    tok = load_tokenizer(tok_dir)
    tok.encode_special_tokens = True
    return tok.encode(text, add_special_tokens=False).ids


def stored_docs(out: Path, split: str = "train") -> list[list[int]]:
    """The documents of a packed split, each without its EOS (checked to be there)."""
    meta = json.loads((out / "meta.json").read_text())
    toks = np.fromfile(out / f"{split}.bin", dtype=np.dtype(meta["dtype"])).tolist()
    idx = np.load(out / f"{split}.idx.npy", allow_pickle=False).tolist() + [len(toks)]
    docs = [toks[a:b] for a, b in zip(idx, idx[1:])]
    assert all(d[-1] == meta["eos_token_id"] for d in docs)
    return [d[:-1] for d in docs]


def mixed_text(n_chars: int, seed: int) -> str:
    """Shakespeare's lines in a seeded order, n_chars long: text that varies, with every kind of line break."""
    lines = SHAKESPEARE.splitlines(keepends=True)
    rng, out, size = random.Random(seed), [], 0
    while size < n_chars:
        line = rng.choice(lines)
        out.append(line)
        size += len(line)
    return "".join(out)


def checksums(d: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.name != "meta.json"}


# ---------------------------------------------------------------- long documents in pieces


def _llama3_style_tokenizer(text: str) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(pa_regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(vocab_size=500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer=trainer)
    return tok


def pa_regex(pattern: str):
    from tokenizers import Regex

    return Regex(pattern)


@pytest.mark.parametrize("kind", ["gpt2_bytelevel", "llama3_split"])
def test_long_document_in_pieces_equals_whole(tok_dir, kind):
    text = mixed_text(600_000, seed=1).replace("\n\n", "\n \n", 50)  # blank lines with spaces: cuts must avoid them
    tok = load_tokenizer(tok_dir) if kind == "gpt2_bytelevel" else _llama3_style_tokenizer(SHAKESPEARE)
    assert cut_safe(tok)
    pieces = [text[i : i + 7_001] for i in range(0, len(text), 7_001)]  # read pieces cut anywhere
    units = list(document_units(pieces, 1, cut=True, piece_chars=20_000))
    assert len(units) > 20 and "".join(u.text for u in units) == text
    assert all(u.text[-1] == "\n" and not u.text[-2].isspace() and not units[i + 1].text[0].isspace()
               for i, u in enumerate(units[:-1]))  # fmt: skip
    assert [u.first for u in units] == [True] + [False] * (len(units) - 1) and units[-1].last
    ids, lengths = token_stream.encode_texts(tok, [u.text for u in units], np.dtype("<u2"))
    assert ids.tolist() == tok.encode(text, add_special_tokens=False).ids and len(lengths) == len(units)


def test_tokenizers_that_cannot_be_cut_get_whole_documents(tok_dir):
    tok = load_tokenizer(tok_dir)
    tok.normalizer = normalizers.Lowercase()
    assert not cut_safe(tok)
    meta = Tokenizer(models.BPE())
    meta.pre_tokenizer = pre_tokenizers.Metaspace()
    assert not cut_safe(meta)
    units = list(document_units(["a\nb\n" * 10_000], 1, cut=cut_safe(tok), piece_chars=100))
    assert len(units) == 1


def test_whole_file_document_streamed_through_preprocess(tok_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(token_stream, "PIECE_CHARS", 50_000)
    monkeypatch.setattr("meshformer.data.sources.READ_CHARS", 4096)
    monkeypatch.setattr("meshformer.data.preprocess.BATCH_DOCS", 3)
    seen = []
    real = token_stream.encode_texts
    monkeypatch.setattr(token_stream, "encode_texts", lambda t, texts, d: seen.append(texts) or real(t, texts, d))
    text = mixed_text(1_200_000, seed=2)
    f = tmp_path / "big.txt"
    f.write_text(text, encoding="utf-8")
    s = preprocess([f], tok_dir, tmp_path / "ds", val_fraction=0.02, **QUIET)
    whole = encode(tok_dir, text)
    assert s["split_mode"] == "tail" and len(seen) >= 8  # one document, encoded in many batches of pieces
    assert all(len(b) <= 3 and sum(map(len, b)) < 3 * 50_000 + 200_000 for b in seen)  # bounded by the chunk size
    train, val = stored_docs(tmp_path / "ds"), stored_docs(tmp_path / "ds", "validation")
    assert train[0] + val[0] == whole and len(val[0]) == -(-len(whole) * 2 // 100)


# ---------------------------------------------------------------- input formats


def test_every_input_format_gives_the_tokenizers_ids(tok_dir, tmp_path):
    rng = random.Random(0)
    docs = [mixed_text(rng.randint(50, 3000), seed=i) for i in range(40)]
    table = pa.table({"id": list(range(40)), "text": docs})
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (tmp_path / "d.json").write_text(json.dumps([{"text": d} for d in docs], indent=1))
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=7)
    with pa.OSFile(str(tmp_path / "d.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        for batch in table.to_batches(max_chunksize=9):
            w.write_batch(batch)
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "saved"))
    want = [encode(tok_dir, d) for d in docs]
    for name in ("d.jsonl", "d.json", "d.parquet", "d.arrow", "saved"):
        out = tmp_path / f"out_{name}"
        s = preprocess([tmp_path / name], tok_dir, out, val_fraction=0, **QUIET)
        assert stored_docs(out) == want and s["documents_read"] == 40, name


def test_txt_paragraphs_and_lines(tok_dir, tmp_path, monkeypatch):
    import re

    monkeypatch.setattr("meshformer.data.sources.READ_CHARS", 64)  # long lines arrive in parts
    text = "First para\nstill first " + "x" * 300 + "\n \t\n\n  Second \n\nthird\n" + "y" * 200 + "  \nlast"
    f = tmp_path / "t.txt"
    f.write_text(text)
    paras = [p.strip() for p in re.split(r"\n[ \t]*\n", text) if p.strip()]  # the whole-file rule
    assert [t for _, t in documents.iter_documents([f], split_blank_lines=True)] == paras
    lines = [line for line in text.split("\n") if line.strip()]
    assert [t for _, t in documents.iter_documents([f], text_split="line")] == lines
    s = preprocess([f], tok_dir, tmp_path / "ds", val_fraction=0, text_split="line", **QUIET)
    assert stored_docs(tmp_path / "ds") == [encode(tok_dir, line) for line in lines] and s["text_split"] == "line"


def test_json_array_streamed_element_by_element(tmp_path, monkeypatch):
    records = [{"text": "a" * n, "k": [1, {"x": "]"}]} for n in (10, 5000, 3, 70_000)]
    f = tmp_path / "a.json"
    f.write_text(json.dumps(records))  # one line: no newline to read by
    assert [v for _, v in documents.iter_json_array(f, buffer=256)] == records
    f.write_text(json.dumps(records)[:-30])
    monkeypatch.setattr(documents, "WHOLE_JSON_BYTES", 0)  # too big to parse whole: the streamed error
    with pytest.raises(documents.UserError, match=r"a\.json: not a valid JSON array \(damaged element"):
        list(documents.iter_records(f))


# ---------------------------------------------------------------- batches, workers, dedup


def test_batches_are_bounded_and_workers_write_the_same_bytes(tok_dir, tmp_path):
    units = list(document_units([t], 1, False) for t in ["a" * 10] * 7 + ["b" * 100])
    got = list(batches((u for us in units for u in us), max_units=3, max_chars=25))
    assert [len(b) for b in got] == [3, 3, 2]  # 3 units at most; a batch ends at the unit reaching 25 chars
    text = [mixed_text(20_000, seed=i) for i in range(30)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in text))
    a = preprocess([tmp_path / "d.jsonl"], tok_dir, tmp_path / "a", workers=0, **QUIET)
    b = preprocess([tmp_path / "d.jsonl"], tok_dir, tmp_path / "b", workers=2, **QUIET)
    assert checksums(tmp_path / "a") == checksums(tmp_path / "b") and a["splits"] == b["splits"]
    tok = load_tokenizer(tok_dir)
    with Encoder(tok, np.dtype("<u2"), 2) as enc:
        out = list(enc.encode(batches((u for t in text for u in document_units([t], 1, False)), 4, 10**9)))
    assert [x.tolist() for _, ids in out for x in ids] == [encode(tok_dir, t) for t in text]


def test_dedup_and_split_follow_the_content_hash_across_batches(tok_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(preprocess_scan, "HASH_BATCH", 3)  # duplicates found in earlier batches and the same one
    base = [mixed_text(300, seed=i) for i in range(600)]
    docs = base + [base[5], " " + base[7] + "\n", base[599], base[0], "  \n"]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    s = preprocess([tmp_path / "d.jsonl"], tok_dir, tmp_path / "ds", val_fraction=0.05, **QUIET)
    assert (s["duplicates_found"], s["empty_documents_skipped"], s["split_mode"]) == (4, 1, "document")
    threshold = int(0.05 * 2.0**64)
    val = [t for t in base if int.from_bytes(hashlib.sha256(t.strip().encode()).digest()[16:24], "little") < threshold]
    assert stored_docs(tmp_path / "ds", "validation") == [encode(tok_dir, t) for t in val]
    assert stored_docs(tmp_path / "ds") == [encode(tok_dir, t) for t in base if t not in val]
    seen = SeenHashes(tmp_path / "h.sqlite")
    assert seen.first_seen([b"a", b"b", b"a"]) == [True, True, False] and seen.first_seen([b"b", b"c"]) == [False, True]


# ---------------------------------------------------------------- kill and resume


KILLED_RUN = """
import sys, time
from rich.console import Console
from meshformer.data import preprocess as p, token_stream
token_stream.PIECE_CHARS = 20_000
p.BATCH_DOCS = 1
real = p.write_json
def slow(path, data):
    real(path, data)
    if path.name == "progress.json":
        time.sleep(0.02)
p.write_json = slow
p.preprocess(sys.argv[1:3], sys.argv[3], sys.argv[4], val_fraction=0.02, console=Console(stderr=True))
"""


def test_killed_run_resumes_to_identical_bytes(tok_dir, tmp_path, monkeypatch):
    big = tmp_path / "big.txt"
    big.write_text(mixed_text(400_000, seed=3))  # one document of ~20 pieces: killed in the middle of it
    small = tmp_path / "d.jsonl"
    small.write_text("".join(json.dumps({"text": mixed_text(800, seed=i)}) + "\n" for i in range(100, 160)))
    inputs = [str(big), str(small)]
    out = tmp_path / "ds"
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(KILLED_RUN), *inputs, str(tok_dir), str(out)])
    tmp = tmp_path / f".ds.tmp-{proc.pid}"
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None:
        progress = tmp / "progress.json"
        if progress.is_file() and json.loads(progress.read_text() or "{}").get("units", 0) >= 6:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert tmp.is_dir() and not out.exists(), "the run finished before it could be killed"
    monkeypatch.setattr(token_stream, "PIECE_CHARS", 20_000)
    buf = io.StringIO()
    s = preprocess(inputs, tok_dir, out, val_fraction=0.02, console=Console(file=buf))
    assert "continuing the killed run" in buf.getvalue() and not tmp.exists()
    ref = preprocess(inputs, tok_dir, tmp_path / "ref", val_fraction=0.02, **QUIET)
    assert checksums(out) == checksums(tmp_path / "ref") and s["splits"] == ref["splits"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.txt", "d.jsonl", "ds", "ref"]


def test_stale_run_of_another_job_is_removed_not_resumed(tok_dir, tmp_path):
    f = tmp_path / "a.txt"
    f.write_text(mixed_text(5000, seed=4))
    stale = tmp_path / ".ds.tmp-999999999"
    stale.mkdir()
    (stale / "job.json").write_text(json.dumps({"version": 1, "inputs": "something else"}))
    buf = io.StringIO()
    preprocess([f], tok_dir, tmp_path / "ds", console=Console(file=buf))
    assert not stale.exists() and "left by a preprocess run that was killed" in buf.getvalue()
    whole = stored_docs(tmp_path / "ds")[0] + stored_docs(tmp_path / "ds", "validation")[0]
    assert whole == encode(tok_dir, f.read_text())


# ---------------------------------------------------------------- Megatron output, CLI, bad input


def test_megatron_format_read_by_megatron_core(tok_dir, tmp_path, capsys):
    docs = [mixed_text(500, seed=i) for i in range(30)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs + [docs[3]]))
    argv = ["preprocess", "--input", str(tmp_path / "d.jsonl"), "--tokenizer", str(tok_dir)]
    assert main([*argv, "--output", str(tmp_path / "mg"), "--format", "megatron", "--workers", "1"]) == 0
    assert "--val-fraction 0.02 ignored" in capsys.readouterr().out
    ds = IndexedDataset(str(tmp_path / "mg" / "text_document"))
    assert [ds[i].tolist() for i in range(len(ds))] == [encode(tok_dir, t) + [0] for t in docs]  # + EOS, dup dropped
    meta = json.loads((tmp_path / "mg" / "meta.json").read_text())
    assert meta["format"] == "megatron-indexed" and meta["megatron"] == {"tokens": ds.sequence_lengths.sum(),
                                                                         "documents": 30}  # fmt: skip
    assert sorted(os.listdir(tmp_path / "mg")) == ["meta.json", "text_document.bin", "text_document.idx",
                                                   "tokenizer.json"]  # fmt: skip
    fails(capsys, [*argv, "--output", str(tmp_path / "mg"), "--format", "megatron"], "--overwrite")


def test_bad_inputs_are_one_line(tok_dir, tmp_path, capsys):
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "a.parquet")
    base = ["--tokenizer", str(tok_dir), "--output", str(tmp_path / "o")]
    parquet = ["preprocess", "--input", str(tmp_path / "a.parquet"), *base]
    fails(capsys, parquet, "a.parquet[0]", "cannot tell the format", "body")  # as a .jsonl of such records says
    fails(capsys, [*parquet, "--format", "text"], "a.parquet", "no 'text' column", "body", "--text-field")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(str(tmp_path / "dd"))
    fails(capsys, ["preprocess", "--input", str(tmp_path / "dd"), *base], "DatasetDict", "train", "dd/train")
    (tmp_path / "bad.txt").write_bytes(b"fine\n" * 100 + b"\xff\xfe")
    fails(capsys, ["preprocess", "--input", str(tmp_path / "bad.txt"), *base], "bad.txt", "not UTF-8", "offset 500")
    (tmp_path / "junk.arrow").write_bytes(b"not arrow at all")
    fails(capsys, ["preprocess", "--input", str(tmp_path / "junk.arrow"), *base], "junk.arrow", "not a readable")
    fails(capsys, ["preprocess", "--input", str(tmp_path / "bad.txt"), *base, "--workers", "-1"], "--workers=-1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.parquet", "bad.txt", "dd", "junk.arrow"]
