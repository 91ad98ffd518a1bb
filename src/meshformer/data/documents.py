"""Reading documents from the user's text files: `.txt` (a file, or its blank-line-separated paragraphs, per
document) and `.jsonl` (one object per line, its text field). Shared by `tokenizer train` and `preprocess`;
every malformed input becomes a one-line UserError that names the file, the line and the fix."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

from meshformer.errors import UserError

SUFFIXES = (".txt", ".jsonl")


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
        return path.read_text(encoding="utf-8")  # universal newlines: CRLF files tokenize like LF ones
    except UnicodeDecodeError as e:
        raise UserError(
            f"{path}: not UTF-8 text (bad byte at offset {e.start}): convert it, e.g. `iconv -f latin1 -t utf-8`"
        ) from None


def _iter_jsonl(path: Path, text_field: str) -> Iterator[tuple[str, str]]:
    fix = f'each line must be one JSON object like {{"{text_field}": "..."}}'
    try:
        with path.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise UserError(
                        f"{where}: not valid JSON ({e.msg} at column {e.colno}): fix or delete that line; {fix}"
                    ) from None
                if not isinstance(obj, dict):
                    raise UserError(f"{where}: a JSON {type(obj).__name__}, not an object: {fix}")
                if text_field not in obj:
                    keys = ", ".join(list(obj)[:8]) or "none"
                    raise UserError(f"{where}: no {text_field!r} field (fields: {keys}): {fix}")
                text = obj[text_field]
                if not isinstance(text, str):
                    raise UserError(f"{where}: field {text_field!r} is {type(text).__name__}, not a string: {fix}")
                yield where, text
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text (bad byte at offset {e.start}): convert it to UTF-8") from None


def iter_documents(
    paths: list[Path], text_field: str = "text", split_blank_lines: bool = False
) -> Iterator[tuple[str, str]]:
    """(location, text) of every document, in input order; empty documents included (callers skip them).

    .txt: the whole file is one document, or each blank-line-separated paragraph with split_blank_lines.
    .jsonl: field `text_field` of each non-blank line.
    """
    for p in paths:
        if p.suffix.lower() == ".jsonl":
            yield from _iter_jsonl(p, text_field)
        elif split_blank_lines:
            paras = (para.strip() for para in re.split(r"\n[ \t]*\n", _read_text(p)))
            # Runs of blank lines are layout, not empty documents: don't count them as skipped.
            yield from ((f"{p}#{i}", para) for i, para in enumerate(paras) if para)
        else:
            yield str(p), _read_text(p)
