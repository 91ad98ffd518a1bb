"""Reading documents from the user's text files: `.txt` (a file, or its blank-line-separated paragraphs, per
document), `.jsonl` (one object per line, its text field) and `.json` (a JSON array of such objects, LLaMA-Factory's
file format; a .json file that is not an array is read as JSON Lines, as `datasets.load_dataset("json")` does).
Shared by `tokenizer train`, `preprocess` and instruction data (`iter_records`); every malformed input becomes a
one-line UserError that names the file, the line (JSON Lines) or the element (`FILE[i]`, arrays) and the fix. A NUL
byte, which no text file holds, marks a binary file given as text."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

from meshformer.errors import UserError

SUFFIXES = (".txt", ".jsonl", ".json")


def resolve_inputs(files: list[str] | list[Path], flag: str = "--input") -> list[Path]:
    if not files:
        raise UserError(f"{flag}: no input files given: pass .txt or .jsonl files")
    paths = []
    for f in files:
        p = Path(f)
        if p.is_dir():
            raise UserError(f"{flag}: {str(p)!r} is a directory: pass its files, e.g. {p}/*.txt")
        if not p.is_file():
            raise UserError(f"{flag}: {str(p)!r} does not exist")
        if p.suffix.lower() not in SUFFIXES:
            raise UserError(
                f"{flag}: {str(p)!r} has an unsupported suffix {p.suffix!r}: use .txt (one document "
                f'per file) or .jsonl (one {{"text": ...}} object per line)'
            )
        paths.append(p)
    return paths


def _read_text(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")  # universal newlines: CRLF files tokenize like LF ones
    except UnicodeDecodeError as e:
        raise UserError(
            f"{path}: not UTF-8 text (bad byte at offset {e.start}): convert it, e.g. `iconv -f latin1 -t utf-8`"
        ) from None
    if "\0" in text:
        raise UserError(f"{path}: a binary file, not text (a NUL byte at character {text.index(chr(0))}): give text")
    return text


def _binary(path: Path, lineno: int) -> UserError:
    return UserError(f"{path}:{lineno}: binary data (a NUL byte), not JSON text: is this the right file?")


def iter_records(path: Path) -> Iterator[tuple[str, int, object]]:
    """(where, key, value) of every JSON record of `path`: a .jsonl line (key: its line number, blank lines
    skipped) or an element of a .json array (key: its index). `where` names it in errors: FILE:LINE or FILE[i]."""
    if path.suffix.lower() == ".json":
        text = _read_text(path)
        if not text.strip():
            return  # no records: the caller says there is nothing to read
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            if text.lstrip().startswith("[") or e.msg != "Extra data":
                raise UserError(
                    f"{path}: not a valid JSON array ({e.msg}: line {e.lineno} column {e.colno}; a file cut short "
                    f"ends like this): fix it, or give one record per line as .jsonl"
                ) from None
            data = None  # several values one after another: JSON Lines under a .json name
        if isinstance(data, list):
            yield from ((f"{path}[{i}]", i, v) for i, v in enumerate(data))
            return
        if data is not None:
            raise UserError(
                f"{path}: a JSON {json_type(data)}, not an array of records: write [{{...}}, {{...}}] (or .jsonl)"
            )
    try:
        with path.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                if "\0" in line:
                    raise _binary(path, lineno)
                try:
                    yield f"{path}:{lineno}", lineno, json.loads(line)
                except json.JSONDecodeError as e:
                    cut = " (the file may be cut short)" if not line.endswith("\n") else ""
                    raise UserError(
                        f"{path}:{lineno}: not valid JSON ({e.msg}: column {e.colno}){cut}: fix or delete that line"
                    ) from None
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text (bad byte at offset {e.start}): is this the right file?") from None


def json_type(v) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if v is None else names.get(type(v), type(v).__name__)


def _iter_jsonl(path: Path, text_field: str) -> Iterator[tuple[str, str]]:
    fix = f'each record must be one JSON object like {{"{text_field}": "..."}}'
    for where, _, obj in iter_records(path):
        if not isinstance(obj, dict):
            raise UserError(f"{where}: a JSON {json_type(obj)}, not an object: {fix}")
        if text_field not in obj:
            keys = ", ".join(list(obj)[:8]) or "none"
            raise UserError(f"{where}: no {text_field!r} field (fields: {keys}): {fix}")
        text = obj[text_field]
        if not isinstance(text, str):
            raise UserError(f"{where}: field {text_field!r} is {type(text).__name__}, not a string: {fix}")
        yield where, text


def iter_documents(
    paths: list[Path], text_field: str = "text", split_blank_lines: bool = False
) -> Iterator[tuple[str, str]]:
    """(location, text) of every document, in input order; empty documents included (callers skip them).

    .txt: the whole file is one document, or each blank-line-separated paragraph with split_blank_lines.
    .jsonl / .json: field `text_field` of each record.
    """
    for p in paths:
        if p.suffix.lower() in (".jsonl", ".json"):
            yield from _iter_jsonl(p, text_field)
        elif split_blank_lines:
            paras = (para.strip() for para in re.split(r"\n[ \t]*\n", _read_text(p)))
            # Runs of blank lines are layout, not empty documents: don't count them as skipped.
            yield from ((f"{p}#{i}", para) for i, para in enumerate(paras) if para)
        else:
            yield str(p), _read_text(p)
