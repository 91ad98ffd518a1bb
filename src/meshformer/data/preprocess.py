"""Text files -> a packed token dataset directory (the format `dataset.py` reads; see its docstring).

Two passes over the inputs, so memory stays flat however large the corpus:
  1. scan: hash every document (whitespace-stripped) to find exact duplicates and pick its split;
  2. tokenize in batches (`encode_batch_fast`, parallel in Rust) and append to {split}.bin.

Validation split. A document goes to validation when the hash of its content falls below val_fraction, so
the choice is deterministic, independent of input order, and exact duplicates always share a split (a kept
duplicate cannot leak validation text into training). That share is only close to val_fraction when there
are many documents, so below MIN_EXPECTED_VAL_DOCS expected validation documents (e.g. 9 Shakespeare plays at
0.02, where one unlucky play would be 11% of the text and most runs would get none) the split is by
position instead: the last ceil(val_fraction * n) tokens of every document go to validation, the rest to
training. Each part ends with EOS. Validation then covers every document's style, and is never empty.

Everything is written to a hidden sibling directory and renamed into place at the end, so a failed or
interrupted run never leaves a half-written dataset.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from array import array
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from meshformer.data.documents import iter_documents, resolve_inputs
from meshformer.data.tokenizer import load_tokenizer, special_token_ids, vocab_size
from meshformer.errors import UserError

# dataset.FORMAT, repeated so `meshformer preprocess` and `tokenizer train` don't import torch (1-2 s);
# tests assert the two are equal.
FORMAT = "meshformer-packed-v1"
MIN_EXPECTED_VAL_DOCS = 10  # below this many expected validation documents, split each document by position
BATCH_DOCS = 512  # documents per encode_batch call...
BATCH_CHARS = 8 << 20  # ...or this many characters, whichever comes first (bounds memory with huge documents)

SKIP, TRAIN, VAL = 0, 1, 2


class _SplitWriter:
    """Appends documents (each + EOS) to {split}.bin and records their start offsets."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, eos: int):
        self.path = directory / f"{split}.bin"
        self.idx_path = directory / f"{split}.idx.npy"
        self.fh = self.path.open("wb")
        self.dtype, self.eos = dtype, np.array([eos], dtype=dtype)
        self.offsets = array("q")
        self.tokens = 0

    def add(self, ids: np.ndarray) -> None:
        self.offsets.append(self.tokens)
        self.fh.write(ids.astype(self.dtype, copy=False).tobytes())
        self.fh.write(self.eos.tobytes())
        self.tokens += len(ids) + 1

    def close(self) -> dict:
        self.fh.close()
        np.save(
            self.idx_path,
            np.frombuffer(self.offsets, dtype=np.int64) if self.offsets else np.zeros(0, dtype=np.int64),
            allow_pickle=False,
        )
        return {"tokens": self.tokens, "documents": len(self.offsets)}


# Everything a dataset directory holds; --overwrite replaces only a directory made of these.
WRITES = {"train.bin", "train.idx.npy", "validation.bin", "validation.idx.npy", "meta.json", "tokenizer.json"}
WRITES |= {"train.mask.bin", "validation.mask.bin", "tokenizer_config.json", "chat_template.jinja"}  # data/sft.py


def _check_output(out: Path, overwrite: bool, keep: tuple[Path, ...] = ()) -> None:
    """--output must be new or empty; with --overwrite it may also be a dataset this command wrote, as long as it
    holds none of `keep` (the inputs, the tokenizer): replacing it must never delete what it did not create."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--output={str(out)!r} is a file: give a directory")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not overwrite:
        raise UserError(
            f"--output={str(out)!r} already exists and is not empty: pass --overwrite to replace it, "
            f"or choose another directory"
        )
    root = out.resolve()
    for k in keep:
        if root == k.resolve() or root in k.resolve().parents:
            raise UserError(
                f"--output={str(out)!r} contains {str(k)!r}, which --overwrite would delete: write the dataset to "
                f"another directory"
            )
    foreign = sorted(p.name for p in out.iterdir() if p.name not in WRITES)
    if foreign or not (out / "meta.json").is_file():
        what = f"{', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''}" if foreign else "no meta.json"
        raise UserError(
            f"--output={str(out)!r} is not a dataset written by `meshformer preprocess` ({what}): --overwrite only "
            f"replaces those; choose another directory"
        )


def clean_stale_temps(out: Path) -> list[Path]:
    """Remove `.NAME.tmp-PID` / `.NAME.old-PID` siblings of --output left by preprocess runs that were killed
    (their PID no longer runs); a live run's are left alone."""
    gone = []
    if not out.parent.is_dir():
        return gone
    for p in out.parent.glob(f".{out.name}.*-*"):
        kind, _, pid = p.name[len(out.name) + 2 :].partition("-")
        if kind in ("tmp", "old") and pid.isdigit() and p.is_dir() and not _alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)
            gone.append(p)
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _scan(paths, text_field, split_blank_lines, val_fraction, keep_duplicates) -> tuple[bytearray, dict]:
    """Pass 1: per-document decision (SKIP/TRAIN/VAL by content hash) and counts."""
    decisions = bytearray()
    seen: set[bytes] = set()
    counts = {"read": 0, "empty": 0, "duplicates": 0}
    threshold = int(val_fraction * 2.0**64)
    for _, text in iter_documents(paths, text_field, split_blank_lines):
        counts["read"] += 1
        key = text.strip()
        if not key:
            counts["empty"] += 1
            decisions.append(SKIP)
            continue
        h = hashlib.sha256(key.encode("utf-8")).digest()
        if h[:16] in seen:
            counts["duplicates"] += 1
            if not keep_duplicates:
                decisions.append(SKIP)
                continue
        else:
            seen.add(h[:16])
        decisions.append(VAL if int.from_bytes(h[16:24], "little") < threshold else TRAIN)
    return decisions, counts


def _tokenize(
    tok,
    paths,
    decisions: bytearray,
    mode: str,
    val_fraction: float,
    writers: dict,
    text_field: str,
    split_blank_lines: bool,
) -> None:
    """Pass 2: encode the kept documents in batches and append them to their split (or both, in tail mode)."""
    progress = Progress(
        TextColumn("tokenizing"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("documents"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=not Console(stderr=True).is_terminal,
        transient=True,
    )
    changed = UserError(f"--input: {', '.join(map(str, paths))} changed while being read: re-run")
    batch: list[tuple[str, int]] = []
    chars = done = 0

    def flush() -> None:
        encs = tok.encode_batch_fast([t for t, _ in batch], add_special_tokens=False)
        for enc, (_, d) in zip(encs, batch):
            t = np.asarray(enc.ids, dtype=np.int64)
            if mode == "tail" and len(t) >= 2:
                m = min(len(t) - 1, math.ceil(len(t) * val_fraction))  # >= 1 token each, train keeps >= 1
                writers["train"].add(t[: len(t) - m])
                writers["validation"].add(t[len(t) - m :])
            else:
                writers["validation" if mode == "document" and d == VAL else "train"].add(t)
        batch.clear()

    with progress:
        task = progress.add_task("tokenize", total=len(decisions))
        for i, (_, text) in enumerate(iter_documents(paths, text_field, split_blank_lines)):
            if i >= len(decisions):
                raise changed
            if decisions[i] != SKIP:
                batch.append((text, decisions[i]))
                chars += len(text)
            if len(batch) >= BATCH_DOCS or chars >= BATCH_CHARS:
                flush()
                chars = 0
                progress.update(task, completed=i + 1)
            done = i + 1
        if done != len(decisions):
            raise changed
        if batch:
            flush()
        progress.update(task, completed=done)


def preprocess(
    inputs: list[str] | list[Path],
    tokenizer: str | Path,
    output: str | Path,
    val_fraction: float = 0.02,
    keep_duplicates: bool = False,
    overwrite: bool = False,
    text_field: str = "text",
    split_blank_lines: bool = False,
    console: Console | None = None,
) -> dict:
    """Tokenize `inputs` into the packed dataset directory `output`; returns the summary (meta.json + timing).

    Steps: check the arguments -> load the tokenizer -> scan (dedup, split decisions) -> choose the split
    mode -> tokenize into a hidden temporary directory -> write meta.json -> move it into place.
    """
    t0 = time.perf_counter()
    console = console or Console()
    paths, out, keep = prepare_output(inputs, tokenizer, output, val_fraction, overwrite, console)
    tok, tok_file, tok_bytes = _open_tokenizer(tokenizer)
    ids, vocab = special_token_ids(tok, tokenizer), vocab_size(tok)
    dtype = np.dtype("<u2") if vocab <= 1 << 16 else np.dtype("<u4")
    decisions, counts = _scan(paths, text_field, split_blank_lines, val_fraction, keep_duplicates)
    mode = _split_mode(decisions, val_fraction, paths)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    writers: dict[str, _SplitWriter] = {}
    try:
        writers = {s: _SplitWriter(tmp, s, dtype, ids["eos"]) for s in ("train", "validation")}
        _tokenize(tok, paths, decisions, mode, val_fraction, writers, text_field, split_blank_lines)
        splits = {s: w.close() for s, w in writers.items()}
        (tmp / "tokenizer.json").write_bytes(tok_bytes)
        meta = {
            "format": FORMAT,
            "dtype": dtype.name,
            "tokenizer_hash": hashlib.sha256(tok_bytes).hexdigest(),
            "vocab_size": vocab,
            "eos_token_id": ids["eos"],
            "bos_token_id": ids["bos"],
            "pad_token_id": ids["pad"],
            "splits": splits,
            "duplicates_removed": 0 if keep_duplicates else counts["duplicates"],
            "duplicates_found": counts["duplicates"],
            "documents_read": counts["read"],
            "empty_documents_skipped": counts["empty"],
            "val_fraction": val_fraction,
            "split_mode": mode,
            "text_field": text_field,
            "split_blank_lines": split_blank_lines,
        }
        meta = publish_with_meta(tmp, out, meta, paths, overwrite, keep)
    finally:
        for w in writers.values():
            w.fh.close()  # no-op after close(); on failure, release the files before removing them
        shutil.rmtree(tmp, ignore_errors=True)

    summary = {**meta, "output": str(out), "seconds": round(time.perf_counter() - t0, 3)}
    _print_summary(console, summary, tok_file)
    return summary


def prepare_output(inputs, tokenizer, output, val_fraction: float, overwrite: bool, console) -> tuple:
    """(input paths, output dir, paths --overwrite must never delete), after the checks every preprocess run makes:
    the validation share, the inputs, the output (new, or a dataset this command wrote), leftovers of killed runs."""
    if not 0.0 <= val_fraction < 1.0:  # also rejects NaN
        raise UserError(f"--val-fraction={val_fraction}: must be in [0, 1), e.g. 0.02")
    paths = resolve_inputs(inputs)
    out = Path(output)
    keep = (*paths, Path(tokenizer))
    _check_output(out, overwrite, keep)
    for p in clean_stale_temps(out):
        console.print(f"removed {escape(str(p))}, left by a preprocess run that was killed", soft_wrap=True)
    return paths, out, keep


def _open_tokenizer(tokenizer: str | Path):
    """(tokenizer set up for raw packing, its file, its bytes). The bytes are read now: --output may even be
    the tokenizer's directory, and the copy stored with the data must be the one that encoded it."""
    tok = load_tokenizer(tokenizer)
    tok_file = Path(tokenizer) / "tokenizer.json" if Path(tokenizer).is_dir() else Path(tokenizer)
    tok_bytes = tok_file.read_bytes()
    tok.no_padding()
    tok.no_truncation()  # a foreign tokenizer.json may carry either; both would corrupt the stream
    # Text that happens to contain "<|endoftext|>" must not become a real EOS in the middle of a document.
    tok.encode_special_tokens = True
    return tok, tok_file, tok_bytes


def _split_mode(decisions: bytearray, val_fraction: float, paths: list[Path]) -> str:
    """none (no validation), document (whole documents by hash) or tail (the end of every document)."""
    kept = sum(1 for d in decisions if d != SKIP)
    if kept == 0:
        raise UserError(f"--input: no text in {', '.join(map(str, paths))}: give files with text in them")
    val_docs = decisions.count(VAL)
    if val_fraction == 0:
        return "none"
    if kept * val_fraction >= MIN_EXPECTED_VAL_DOCS and 0 < val_docs < kept:
        return "document"
    return "tail"


def publish_with_meta(tmp: Path, out: Path, meta: dict, paths: list[Path], overwrite: bool, keep: tuple) -> dict:
    """Add the sources and time to `meta`, write meta.json last, and move the finished dataset into place."""
    meta = {
        **meta,
        "sources": [{"path": str(p.resolve()), "bytes": p.stat().st_size} for p in paths],
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    _publish(tmp, out, overwrite, keep)
    return meta


def _publish(tmp: Path, out: Path, overwrite: bool, keep: tuple[Path, ...]) -> None:
    """Move the finished dataset into place; an existing one is removed only after the new one is there."""
    _check_output(out, overwrite, keep)  # again: something may have appeared there while we worked
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old)
    else:
        tmp.rename(out)


def _print_summary(console: Console, s: dict, tok_file: Path) -> None:
    tr, va = s["splits"]["train"], s["splits"]["validation"]
    mode = {
        "document": "whole documents chosen by content hash",
        "tail": f"last {s['val_fraction']:.1%} of every document's tokens",
        "none": "none (--val-fraction 0)",
    }[s["split_mode"]]
    dup = s["duplicates_found"]
    dup_style = "bold yellow" if dup else "green"
    dup_what = (
        "none"
        if not dup
        else f"{dup} dropped"
        if s["duplicates_removed"]
        else f"{dup} KEPT (--keep-duplicates): repeated text makes the loss look lower than it is"
    )
    p = lambda text: console.print(text, soft_wrap=True)  # noqa: E731 - paths must not wrap mid-line
    p(f"[bold]wrote {escape(s['output'])}[/bold] in {s['seconds']:.2f}s")
    p(f"  documents   {s['documents_read']} read, {s['empty_documents_skipped']} empty skipped")
    p(f"  duplicates  [{dup_style}]{dup} exact duplicate document(s) found: {dup_what}[/{dup_style}]")
    p(f"  train       {tr['tokens']:,} tokens in {tr['documents']} documents")
    p(f"  validation  {va['tokens']:,} tokens in {va['documents']} documents ({mode})")
    p(
        f"  tokenizer   {escape(str(tok_file))} (vocab {s['vocab_size']}, eos id {s['eos_token_id']}, "
        f"sha256 {s['tokenizer_hash'][:12]}), stored as {s['dtype']}"
    )
