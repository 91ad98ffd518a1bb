"""Reading documents from the user's files: `.txt` (a file, its blank-line-separated paragraphs, or its lines per
document), `.jsonl` (one object per line, its text field), `.json` (a JSON array of such objects, LLaMA-Factory's
file format; a .json file that is not an array is read as JSON Lines, as `datasets.load_dataset("json")` does), and
`.parquet` / `.arrow` files and `datasets.save_to_disk` folders (their rows). Everything is read as a stream
(sources.py): `iter_document_pieces` never holds more than a piece of a document, whatever the file's size.
Shared by `tokenizer train`, `preprocess` and instruction data (`iter_records`); every malformed input becomes a
one-line UserError that names the file, the line (JSON Lines) or the element (`FILE[i]`, arrays) and the fix. A NUL
byte, which no text file holds, marks a binary file given as text."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from meshformer.data.sources import (
    ARROW_SUFFIXES,
    TooDeep,
    is_dataset_dir,
    iter_json_array,
    iter_rows,
    txt_documents,
)
from meshformer.errors import UserError

SUFFIXES = (".txt", ".jsonl", ".json", *ARROW_SUFFIXES)
TEXT_SPLITS = ("file", "paragraph", "line")
WHOLE_JSON_BYTES = 64 << 20  # a .json file this small that fails to stream is parsed whole, for the exact error


def resolve_inputs(files: list[str] | list[Path], flag: str = "--input") -> list[Path]:
    if not files:
        raise UserError(f"{flag}: no input files given: pass .txt or .jsonl files")
    paths = []
    for f in files:
        p = Path(f)
        if is_dataset_dir(p):
            paths.append(p)
            continue
        if p.is_dir():
            raise UserError(
                f"{flag}: {str(p)!r} is a directory (not a datasets.save_to_disk folder): pass its files, e.g. "
                f"{p}/*.txt"
            )
        if not p.is_file():
            raise UserError(f"{flag}: {str(p)!r} does not exist")
        if p.suffix.lower() not in SUFFIXES:
            raise UserError(
                f"{flag}: {str(p)!r} has an unsupported suffix {p.suffix!r}: use .txt (one document "
                f'per file), .jsonl (one {{"text": ...}} object per line), .json, .parquet or .arrow'
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


def _streamed_array(path: Path) -> Iterator[tuple[str, int, object]]:
    """The elements of a .json array, streamed. Returns False when iter_records' whole-file parse should take over:
    a small file that is not an array (its error, or JSON Lines) or one too damaged to stream (its wording)."""
    small = path.stat().st_size <= WHOLE_JSON_BYTES
    if small:
        with path.open("rb") as fh:
            if fh.read(4096).lstrip()[:1] != b"[":
                return False
    try:
        for i, v in iter_json_array(path):
            yield f"{path}[{i}]", i, checked_record(f"{path}[{i}]", v)
    except TooDeep as e:
        raise too_deep(f"{path}[{e.index}]") from None
    except ValueError as e:
        if small:
            try:
                json.loads(_read_text(path))
            except (ValueError, RecursionError):
                return False
        raise UserError(
            f"{path}: not a valid JSON array ({e}; a file cut short ends like this): fix it, or give one record per "
            f"line as .jsonl"
        ) from None
    return True


def _binary(path: Path, lineno: int) -> UserError:
    return UserError(f"{path}:{lineno}: binary data (a NUL byte), not JSON text: is this the right file?")


def iter_records(path: Path) -> Iterator[tuple[str, int, object]]:
    """(where, key, value) of every JSON record of `path`: a .jsonl line (key: its line number, blank lines
    skipped), an element of a .json array (key: its index), or a row of a Parquet/Arrow file or save_to_disk
    folder, as a dict (key: its row number). `where` names it in errors: FILE:LINE or FILE[i]. Nothing is read
    whole but a small .json file that is not one array."""
    if is_dataset_dir(path) or path.suffix.lower() in ARROW_SUFFIXES:
        yield from iter_rows(path)
        return
    if path.suffix.lower() == ".json":
        streamed = yield from _streamed_array(path)
        if streamed:
            return
        text = _read_text(path)
        if not text.strip():
            return  # no records: the caller says there is nothing to read
        try:
            data = json.loads(text)
        except RecursionError:
            raise too_deep(str(path)) from None
        except json.JSONDecodeError as e:
            if text.lstrip().startswith("[") or e.msg != "Extra data":
                raise UserError(
                    f"{path}: not a valid JSON array ({e.msg}: line {e.lineno} column {e.colno}; a file cut short "
                    f"ends like this): fix it, or give one record per line as .jsonl"
                ) from None
            data = None  # several values one after another: JSON Lines under a .json name
        if isinstance(data, list):
            yield from ((f"{path}[{i}]", i, checked_record(f"{path}[{i}]", v)) for i, v in enumerate(data))
            return
        if data is not None:
            check_depth(str(path), data)
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
                    record = json.loads(line)
                except RecursionError:
                    raise too_deep(f"{path}:{lineno}") from None
                except json.JSONDecodeError as e:
                    cut = " (the file may be cut short)" if not line.endswith("\n") else ""
                    raise UserError(
                        f"{path}:{lineno}: not valid JSON ({e.msg}: column {e.colno}){cut}: fix or delete that line"
                    ) from None
                yield f"{path}:{lineno}", lineno, checked_record(f"{path}:{lineno}", record, line)
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text (bad byte at offset {e.start}): is this the right file?") from None


# Deeper than any real record. Python's JSON parser recurses once per level, so a deeper record raises
# RecursionError at the interpreter's recursion limit, a limit libraries raise (MindSpore's import sets it far
# higher): the depth is checked itself, so the same file is refused in every process.
MAX_JSON_DEPTH = 512


def too_deep(where: str) -> UserError:
    return UserError(
        f"{where}: JSON nested too deeply (more than {MAX_JSON_DEPTH} levels of arrays and objects): flatten or "
        f"delete that record"
    )


def nesting_depth(value) -> int:
    """Levels of arrays and objects in a parsed JSON value, counted without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, depth = stack.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


def check_depth(where: str, record, raw: str | None = None):
    """record, refused when nested deeper than MAX_JSON_DEPTH; `raw`, its JSON text, skips the walk when it holds
    too few brackets to be that deep."""
    if raw is not None and raw.count("[") + raw.count("{") <= MAX_JSON_DEPTH:
        return record
    if nesting_depth(record) > MAX_JSON_DEPTH:
        raise too_deep(where)
    return record


def checked_record(where: str, record, raw: str | None = None):
    """record, refused when a string in it holds a lone surrogate: valid JSON (an escape such as \\ud800 without
    its pair) but no text, which neither UTF-8 nor a tokenizer takes. `raw`, the record's JSON text, skips the
    check when it has no \\u escape of a surrogate."""
    check_depth(where, record, raw)
    if raw is not None and "\\ud" not in raw.lower():
        return record
    try:
        json.dumps(record, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise UserError(
            f"{where}: a string holds \\u{ord(e.object[e.start]):04x}, a lone surrogate (half of a UTF-16 pair), "
            f"which is not text: fix the escape (a pair such as \\ud83d\\ude00, or the character itself) or "
            f"delete that record"
        ) from None
    except RecursionError:
        raise too_deep(where) from None
    return record


def json_type(v) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if v is None else names.get(type(v), type(v).__name__)


def _iter_jsonl(path: Path, text_field: str) -> Iterator[tuple[str, str]]:
    fix = f'each record must be one JSON object like {{"{text_field}": "..."}}'
    arrow = is_dataset_dir(path) or path.suffix.lower() in ARROW_SUFFIXES
    for where, _, obj in iter_rows(path, [text_field]) if arrow else iter_records(path):
        if not isinstance(obj, dict):
            raise UserError(f"{where}: a JSON {json_type(obj)}, not an object: {fix}")
        if text_field not in obj:
            keys = ", ".join(list(obj)[:8]) or "none"
            raise UserError(f"{where}: no {text_field!r} field (fields: {keys}): {fix}")
        text = obj[text_field]
        if not isinstance(text, str):
            raise UserError(f"{where}: field {text_field!r} is {type(text).__name__}, not a string: {fix}")
        yield where, text


def iter_document_pieces(
    paths: list[Path], text_field: str = "text", text_split: str = "file"
) -> Iterator[tuple[str, Iterator[str]]]:
    """(location, pieces of its text) of every document, in input order; empty documents included (callers skip
    them). A document's pieces must be consumed before the next document is asked for.

    .txt: the whole file, each blank-line-separated paragraph (stripped) or each line, as `text_split` says.
    .jsonl / .json / .parquet / .arrow / save_to_disk folders: field `text_field` of each record, in one piece.
    """
    if text_split not in TEXT_SPLITS:
        raise UserError(f"--text-split={text_split!r}: must be one of {', '.join(TEXT_SPLITS)}")
    for p in paths:
        if p.suffix.lower() == ".txt":
            yield from txt_documents(p, text_split)
        else:
            yield from ((where, iter((text,))) for where, text in _iter_jsonl(p, text_field))


def iter_documents(
    paths: list[Path], text_field: str = "text", split_blank_lines: bool = False, text_split: str | None = None
) -> Iterator[tuple[str, str]]:
    """(location, text) of every document, in input order, each joined whole (`tokenizer train`; `preprocess`
    streams the pieces instead). `text_split` defaults to paragraph with split_blank_lines, else file."""
    text_split = text_split or ("paragraph" if split_blank_lines else "file")
    for where, pieces in iter_document_pieces(paths, text_field, text_split):
        yield where, "".join(pieces)
