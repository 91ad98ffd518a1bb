"""Text -> a packed token dataset directory (the format `dataset.py` reads; see its docstring), or a Megatron
indexed dataset (`--format megatron`), streamed in bounded memory: peak memory is set by the batch size, not
the corpus.

Two passes over the inputs:
  1. scan (preprocess_scan.py): hash every document (whitespace-stripped) to find exact duplicates and pick its
     split; one byte per document on disk, the hashes in SQLite;
  2. tokenize in batches of units (token_stream.py: whole documents, or pieces of long ones cut where the
     ids cannot change), in this process or in --workers processes, and append to {split}.bin as they come.

Validation split. A document goes to validation when the hash of its content falls below val_fraction, so
the choice is deterministic, independent of input order, and exact duplicates always share a split (a kept
duplicate cannot leak validation text into training). That share is only close to val_fraction when there
are many documents, so below MIN_EXPECTED_VAL_DOCS expected validation documents (e.g. 9 Shakespeare plays at
0.02, where one unlucky play would be 11% of the text and most runs would get none) the split is by
position instead: the last ceil(val_fraction * n) tokens of every document go to validation, the rest to
training. Each part ends with EOS. Validation then covers every document's style, and is never empty.
Megatron output has no validation split here: Megatron's `split` carves it at training time.

Everything is written to a hidden sibling directory and renamed into place at the end, so a failed run never
leaves a half-written dataset; a killed one leaves that directory, and the same command run again continues
from its last completed batch (preprocess_resume.py), to the bytes an uninterrupted run writes.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from meshformer.data import preprocess_resume as resume
from meshformer.data import token_stream
from meshformer.data.documents import TEXT_SPLITS, iter_document_pieces, resolve_inputs
from meshformer.data.packed_writer import SplitWriter, write_megatron
from meshformer.data.preprocess_report import print_summary
from meshformer.data.preprocess_resume import write_json
from meshformer.data.preprocess_scan import SKIP, VAL, decisions, scan
from meshformer.data.token_stream import Encoder, batches, cut_safe, document_units, prepare_tokenizer
from meshformer.data.tokenizer import load_tokenizer, special_token_ids, vocab_size
from meshformer.errors import UserError

# dataset.FORMAT, repeated so `meshformer preprocess` and `tokenizer train` don't import torch (1-2 s);
# tests assert the two are equal.
FORMAT = "meshformer-packed-v1"
MEGATRON_FORMAT = "megatron-indexed"
MEGATRON_PREFIX = "text_document"
OUTPUT_FORMATS = ("packed", "megatron")
MIN_EXPECTED_VAL_DOCS = 10  # below this many expected validation documents, split each document by position
BATCH_DOCS = 512  # units (documents or pieces) per batch...
BATCH_CHARS = 8 << 20  # ...or this many characters, whichever comes first (what one worker encodes at a time)
SPLITS = ("train", "validation")


# Everything a dataset directory holds; --overwrite replaces only a directory made of these.
WRITES = {"train.bin", "train.idx.npy", "validation.bin", "validation.idx.npy", "meta.json", "tokenizer.json"}
WRITES |= {"train.mask.bin", "validation.mask.bin", "tokenizer_config.json", "chat_template.jinja"}  # data/sft.py
WRITES |= {f"{MEGATRON_PREFIX}.bin", f"{MEGATRON_PREFIX}.idx"}  # --format megatron


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


def _progress_bar(total: int) -> Progress:
    return Progress(
        TextColumn("tokenizing"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("documents"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=not Console(stderr=True).is_terminal,
        transient=True,
    )


def _units(tok, paths, text_field: str, text_split: str, tmp: Path, seen: list[int]):
    """Every kept document's units, in order, checked against pass 1's document count (seen[0]: documents read)."""
    changed = UserError(f"--input: {', '.join(map(str, paths))} changed while being read: re-run")
    cut, fates = cut_safe(tok), decisions(tmp)
    for _, pieces in iter_document_pieces(paths, text_field, text_split):
        fate = next(fates, None)
        if fate is None:
            raise changed
        seen[0] += 1
        if fate == SKIP:
            for _ in pieces:  # read past it: the next document starts where it ends
                pass
            continue
        yield from document_units(pieces, fate, cut)
    if next(fates, None) is not None:
        raise changed


def _tokenize(tok, paths, job: dict, mode: str, writers: dict, tmp: Path, workers: int, state: dict | None) -> None:
    """Pass 2: encode the kept documents' units in batches and append them to their split (or both, in tail mode),
    recording progress after each batch; `state` (a killed run's progress) skips what it already wrote."""
    done, open_doc, seen = (state["units"], state["open"], [0]) if state else (0, None, [0])
    units = itertools.islice(_units(tok, paths, job["text_field"], job["text_split"], tmp, seen), done, None)
    with _progress_bar(0) as progress, Encoder(tok, writers["train"].dtype, workers) as encoder:
        task = progress.add_task("tokenize", total=job.get("documents"))
        for batch, ids in encoder.encode(batches(units, BATCH_DOCS, BATCH_CHARS)):
            for unit, unit_ids in zip(batch, ids):
                if unit.first:
                    split = "validation" if mode == "document" and unit.decision == VAL else "train"
                    open_doc = {"split": split, "start": writers[split].begin()}
                writer = writers[open_doc["split"]]
                writer.append(unit_ids)
                if unit.last:
                    if mode == "tail":
                        writer.move_tail(open_doc["start"], job["val_fraction"], writers["validation"])
                    else:
                        writer.end()
                    open_doc = None
            done += len(batch)
            splits = {s: w.state() for s, w in writers.items()}
            write_json(tmp / resume.PROGRESS, {"units": done, "open": open_doc, "splits": splits})
            progress.update(task, completed=seen[0])


def _writers(tmp: Path, dtype: np.dtype, eos: int, state: dict | None) -> dict[str, SplitWriter]:
    """The split writers, fresh or at a killed run's recorded state."""
    return {s: SplitWriter(tmp, s, dtype, eos, state["splits"][s] if state else None) for s in SPLITS}


def _resumable_state(tmp: Path, dtype: np.dtype) -> dict | None:
    """A killed run's progress, if its files still hold at least what it recorded; None: start pass 2 afresh."""
    state = resume.read_progress(tmp)
    try:
        for s in SPLITS:
            st = state["splits"][s]
            if (tmp / f"{s}.bin").stat().st_size < st["tokens"] * dtype.itemsize:
                return None
            if (tmp / f"{s}.idx.raw").stat().st_size < st["documents"] * 8:
                return None
        return state if isinstance(state["units"], int) else None
    except (OSError, KeyError, TypeError):
        return None


def _temp_dir(out: Path, job: dict, console) -> tuple[Path, bool]:
    """(this run's temporary directory, whether it continues a killed run's)."""
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    claimed = resume.claim(out, job, _alive)
    if claimed is not None:
        console.print(f"continuing the killed run left in {escape(str(tmp))}", soft_wrap=True)
        return tmp, True
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write_json(tmp / resume.JOB, job)
    return tmp, False


def _run_passes(tok, paths, job: dict, tmp: Path, dtype: np.dtype, eos: int, workers: int) -> tuple[dict, str, dict]:
    """Both passes into tmp (each skipped or continued where a killed run got); (counts, split mode, splits)."""
    counts = resume.read_scan(tmp)
    if counts is None:
        (tmp / resume.PROGRESS).unlink(missing_ok=True)  # pass 2 output of a scan that never finished is void
        args = (job["text_field"], job["text_split"], job["val_fraction"], job["keep_duplicates"], tmp)
        counts = scan(paths, *args)
        write_json(tmp / resume.SCAN, counts)
    mode = _split_mode(counts, job["val_fraction"], paths)
    state = _resumable_state(tmp, dtype)
    writers = _writers(tmp, dtype, eos, state)
    try:
        _tokenize(tok, paths, {**job, "documents": counts["read"]}, mode, writers, tmp, workers, state)
        splits = {s: w.close() for s, w in writers.items()}
    finally:
        for w in writers.values():
            w.fh.close()  # no-op after close(); on failure, release the files before removing them
            w.raw.close()
    for name in resume.SCRATCH:
        (tmp / name).unlink(missing_ok=True)
    return counts, mode, splits


def _checked_options(
    text_split, split_blank_lines: bool, output_format: str, workers: int, val_fraction: float, console
) -> tuple[str, float]:
    """(the .txt split, the validation share) once the options are checked: one line for a bad one."""
    text_split = text_split or ("paragraph" if split_blank_lines else "file")
    if text_split not in TEXT_SPLITS:
        raise UserError(f"--text-split={text_split!r}: must be one of {', '.join(TEXT_SPLITS)}")
    if output_format not in OUTPUT_FORMATS:
        raise UserError(f"--format={output_format!r}: must be one of {', '.join(OUTPUT_FORMATS)}")
    if workers < 0:
        raise UserError(f"--workers={workers}: must be 0 (this process) or more")
    if output_format == "megatron" and val_fraction:
        console.print(f"--val-fraction {val_fraction} ignored: Megatron's `split` carves validation at training time")
        val_fraction = 0.0
    if not 0.0 <= val_fraction < 1.0:  # also rejects NaN; prepare_output checks it again, before the temp dir
        raise UserError(f"--val-fraction={val_fraction}: must be in [0, 1), e.g. 0.02")
    return text_split, val_fraction


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
    *,
    text_split: str | None = None,
    workers: int = 0,
    output_format: str = "packed",
) -> dict:
    """Tokenize `inputs` into the dataset directory `output`; returns the summary (meta.json + timing).

    text_split: how a .txt file becomes documents (file, paragraph, line; default paragraph with
    split_blank_lines, else file). workers: tokenizer processes (0: this process, with the tokenizer's own
    threads). output_format: packed (meshformer's) or megatron (one text_document.bin/.idx, no validation split).
    Steps: check the arguments -> load the tokenizer -> claim a killed run's temporary directory or make one ->
    scan (dedup, split decisions) -> choose the split mode -> tokenize -> write meta.json -> move it into place.
    """
    t0 = time.perf_counter()
    console = console or Console()
    text_split, val_fraction = _checked_options(
        text_split, split_blank_lines, output_format, workers, val_fraction, console
    )
    tok, tok_file, tok_bytes = _open_tokenizer(tokenizer)
    ids, vocab = special_token_ids(tok, tokenizer), vocab_size(tok)
    dtype = np.dtype("<u2") if vocab <= 1 << 16 else np.dtype("<u4")
    options = dict(text_field=text_field, text_split=text_split, val_fraction=val_fraction)
    options.update(keep_duplicates=keep_duplicates, format=output_format, eos=ids["eos"], dtype=dtype.str)
    options.update(piece_chars=token_stream.PIECE_CHARS, cut_safe=cut_safe(tok))  # they decide the units
    job = resume.job_description(resolve_inputs(inputs), hashlib.sha256(tok_bytes).hexdigest(), **options)
    out = Path(output)
    _check_output(out, overwrite, (*resolve_inputs(inputs), Path(tokenizer)))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp, _ = _temp_dir(out, job, console)
    try:
        paths, out, keep = prepare_output(inputs, tokenizer, output, val_fraction, overwrite, console)
        counts, mode, splits = _run_passes(tok, paths, job, tmp, dtype, ids["eos"], workers)
        if output_format == "megatron":
            megatron = write_megatron(tmp, "train", dtype, tmp / MEGATRON_PREFIX)
            for s in SPLITS:
                (tmp / f"{s}.bin").unlink()
                (tmp / f"{s}.idx.npy").unlink()
        (tmp / "tokenizer.json").write_bytes(tok_bytes)
        meta = {
            "format": FORMAT if output_format == "packed" else MEGATRON_FORMAT,
            **({"prefix": MEGATRON_PREFIX, "megatron": megatron} if output_format == "megatron" else {}),
            "dtype": dtype.name,
            "tokenizer_hash": job["tokenizer_hash"],
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
            "split_blank_lines": text_split == "paragraph",
            "text_split": text_split,
        }
        meta = publish_with_meta(tmp, out, meta, paths, overwrite, keep)
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)  # bad input or a bug: nothing worth continuing from
        raise
    # A kill or Ctrl-C (not an Exception) leaves tmp for the next run of the same command to continue.

    summary = {**meta, "output": str(out), "seconds": round(time.perf_counter() - t0, 3)}
    print_summary(console, summary, tok_file)
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
    prepare_tokenizer(tok)  # a foreign tokenizer.json may carry padding or truncation; both would corrupt the stream
    return tok, tok_file, tok_bytes


def _split_mode(counts: dict, val_fraction: float, paths: list[Path]) -> str:
    """none (no validation), document (whole documents by hash) or tail (the end of every document)."""
    kept, val_docs = counts["kept"], counts["validation"]
    if kept == 0:
        raise UserError(f"--input: no text in {', '.join(map(str, paths))}: give files with text in them")
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
