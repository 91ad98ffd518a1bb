"""Reading inputs in bounded memory: `.txt` files as a stream of text pieces (a whole file, its blank-line-separated
paragraphs or its lines per document), `.json` arrays element by element, and Parquet files, Arrow files and
`datasets.save_to_disk` folders (pyarrow, one record batch at a time) as rows.

A document is `(where, pieces)`: `pieces` yields its text in order, each piece at most about READ_CHARS
characters unless one line is longer, so a file of any size is never held whole. documents.py composes these into
the iterators `preprocess`, `tokenizer train` and instruction data use.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from pathlib import Path

from meshformer.errors import UserError, first_line

READ_CHARS = 1 << 20  # text read per piece of a .txt document
ARROW_SUFFIXES = (".parquet", ".arrow")
ROWS_PER_BATCH = 1024  # Parquet/Arrow rows decoded at a time


def not_utf8(path: Path, offset: int) -> UserError:
    return UserError(
        f"{path}: not UTF-8 text (bad byte at offset {offset}): convert it, e.g. `iconv -f latin1 -t utf-8`"
    )


def iter_lines(path: Path, limit: int = READ_CHARS) -> Iterator[str]:
    """The file's text as lines (each ending in "\\n" but the last), universal newlines like open(); a line longer
    than `limit` comes in several parts. Checks UTF-8 and NUL bytes as it goes."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, pending_cr = 0, False
    with path.open("rb") as fh:
        while True:
            raw = fh.readline(limit)
            try:
                text = decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as e:
                raise not_utf8(path, offset + e.start) from None
            offset += len(raw)
            if "\0" in text:
                raise UserError(f"{path}: a binary file, not text (a NUL byte near byte {offset}): give text")
            if pending_cr:  # "\r" ended the previous read: a "\n" here belongs to it
                text = text[1:] if text.startswith("\n") else text
            pending_cr = text.endswith("\r")
            if "\r" in text:
                text = text.replace("\r\n", "\n").replace("\r", "\n")
            if text:
                yield text
            if not raw:
                return


def _pieces(lines: Iterator[str], first: str = "") -> Iterator[str]:
    """Lines joined into pieces of about READ_CHARS characters."""
    buf, size = ([first], len(first)) if first else ([], 0)
    for line in lines:
        buf.append(line)
        size += len(line)
        if size >= READ_CHARS:
            yield "".join(buf)
            buf, size = [], 0
    if buf:
        yield "".join(buf)


def stripped(pieces: Iterator[str]) -> Iterator[str]:
    """The pieces of `"".join(pieces).strip()`, without joining them: trailing whitespace is held back until
    text follows it."""
    started, held = False, []
    for piece in pieces:
        if not started:
            piece = piece.lstrip()
            if not piece:
                continue
            started = True
        body = piece.rstrip()
        if body:
            yield "".join(held) + body
            held = []
        held.append(piece[len(body) :])


def _blank(line: str) -> bool:
    return line.endswith("\n") and not line[:-1].strip(" \t")


def _until_newline(first: str, lines: Iterator[str]) -> Iterator[str]:
    """The parts of one line (iter_lines cuts lines longer than its limit), starting with `first`."""
    yield first[:-1] if first.endswith("\n") else first
    part = first
    while not part.endswith("\n"):
        part = next(lines, None)
        if part is None:
            return
        yield part[:-1] if part.endswith("\n") else part


def txt_documents(path: Path, text_split: str) -> Iterator[tuple[str, Iterator[str]]]:
    """`(where, pieces)` of each document of a .txt file: the whole file (`file`), each paragraph between lines of
    only spaces and tabs, stripped (`paragraph`; empty ones are layout and skipped), or each line without its
    newline (`line`; blank lines skipped). A caller must consume a document's pieces before asking for the next."""
    lines = iter_lines(path)
    if text_split == "file":
        yield str(path), _pieces(lines)
        return
    lineno = 0
    if text_split == "line":
        for first in lines:
            lineno += 1
            if first.endswith("\n") and not first.strip():
                continue
            yield f"{path}:{lineno}", _until_newline(first, lines)
        return
    ended, line_start = False, True  # line_start: the next part begins a line (a long line comes in parts)

    def paragraph(first: str) -> Iterator[str]:
        nonlocal ended, line_start
        buf, size = [first], len(first)
        line_start = first.endswith("\n")
        for line in lines:
            if line_start and _blank(line):
                break
            line_start = line.endswith("\n")
            buf.append(line)
            size += len(line)
            if size >= READ_CHARS:
                yield "".join(buf)
                buf, size = [], 0
        else:
            ended = True
        yield "".join(buf)

    index = 0
    while not ended:
        first = next(lines, None)
        if first is None:
            return
        if _blank(first):  # a paragraph ended just before: this line starts one
            continue
        yield f"{path}#{index}", stripped(paragraph(first))
        index += 1


class TooDeep(ValueError):
    """Element `index` of a JSON array nests deeper than Python's parser recurses."""

    def __init__(self, index: int):
        super().__init__(f"element {index} nested too deeply")
        self.index = index


def iter_json_array(path: Path, buffer: int = READ_CHARS) -> Iterator[tuple[int, object]]:
    """(index, element) of a .json file holding one array, parsed element by element. A damaged file raises
    ValueError (the caller words the error; TooDeep for an element nested too deeply to parse); the buffer grows to
    hold the largest element."""
    decoder = json.JSONDecoder()
    text, pos, eof, index = "", 0, False, 0
    lines = iter_lines(path, buffer)

    def more(want: int = buffer) -> bool:
        nonlocal text, pos, eof
        parts, size = [], 0
        while size < want:
            line = next(lines, None)
            if line is None:
                eof = True
                break
            parts.append(line)
            size += len(line)
        text, pos = text[pos:] + "".join(parts), 0
        return size > 0

    def skip_ws() -> str:
        nonlocal pos
        while True:
            while pos < len(text) and text[pos] in " \t\n\r":
                pos += 1
            if pos < len(text) or not more():
                return text[pos] if pos < len(text) else ""

    if skip_ws() != "[":
        raise ValueError("not an array")
    pos += 1
    if skip_ws() == "]":
        pos += 1
    else:
        while True:
            skip_ws()
            want = buffer
            while True:
                try:
                    value, end = decoder.raw_decode(text, pos)
                    if end < len(text) or eof or not more(want):  # a number may go on in the next chunk
                        break
                except json.JSONDecodeError:
                    if eof or not more(want):
                        raise ValueError("damaged element") from None
                except RecursionError:
                    raise TooDeep(index) from None
                want *= 2  # an element larger than the buffer: read twice as much before parsing it again
            yield index, value
            index, pos = index + 1, end
            c = skip_ws()
            pos += 1
            if c == "]":
                break
            if c != ",":
                raise ValueError("expected , or ]")
    if skip_ws():
        raise ValueError("data after the array")


# ---------------------------------------------------------------- Parquet, Arrow, datasets.save_to_disk folders


def is_dataset_dir(p: Path) -> bool:
    return p.is_dir() and ((p / "state.json").is_file() or (p / "dataset_dict.json").is_file())


def arrow_files(path: Path) -> list[Path]:
    """The files of a Parquet/Arrow input, in order: the file itself, or a save_to_disk folder's data files."""
    if path.is_file():
        return [path]
    if (path / "dataset_dict.json").is_file():
        splits = _json(path / "dataset_dict.json").get("splits", [])
        raise UserError(
            f"--input: {str(path)!r} is a DatasetDict (splits: {', '.join(map(str, splits)) or 'none'}): pass one "
            f"split's folder, e.g. {path}/{splits[0] if splits else 'train'}"
        )
    state = _json(path / "state.json")
    files = [f.get("filename") for f in state.get("_data_files", []) if isinstance(f, dict)]
    if not files or not all(isinstance(f, str) and (path / f).is_file() for f in files):
        raise UserError(f"{path}/state.json: no readable _data_files listed: re-save it with datasets.save_to_disk")
    return [path / f for f in files]


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: not readable JSON ({first_line(e)}): re-save it with datasets.save_to_disk") from None
    return data if isinstance(data, dict) else {}


def _record_batches(path: Path, columns: list[str] | None):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if path.suffix.lower() == ".parquet":
            parquet = pq.ParquetFile(path)
            missing = [c for c in columns or () if c not in parquet.schema_arrow.names]
            if missing:
                raise KeyError(missing[0])
            yield from parquet.iter_batches(batch_size=ROWS_PER_BATCH, columns=columns)
            return
        source = pa.memory_map(str(path))
        try:
            reader = pa.ipc.open_file(source)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        except pa.ArrowInvalid:  # datasets writes the Arrow stream format
            source.seek(0)
            batches = iter(pa.ipc.open_stream(source))
        for batch in batches:
            if columns is not None:
                missing = [c for c in columns if c not in batch.schema.names]
                if missing:
                    raise KeyError(missing[0])
                batch = batch.select(columns)
            for start in range(0, batch.num_rows, ROWS_PER_BATCH):
                yield batch.slice(start, ROWS_PER_BATCH)
    except KeyError as e:
        raise _no_column(path, e.args[0], columns) from None
    except (pa.ArrowException, OSError) as e:
        if "No match for FieldRef" in str(e) and columns:
            raise _no_column(path, columns[0], columns) from None
        what = f"not a readable Parquet/Arrow file ({first_line(e)})"
        raise UserError(f"{path}: {what}: is this the right file?") from None


def _no_column(path: Path, name: str, columns) -> UserError:
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(path).names if path.suffix.lower() == ".parquet" else None
    except Exception:  # the schema is only for the message
        names = None
    fields = f" (columns: {', '.join(names[:8])})" if names else ""
    return UserError(f"{path}: no {name!r} column{fields}: pass --text-field NAME")


def iter_rows(path: Path, columns: list[str] | None = None) -> Iterator[tuple[str, int, dict]]:
    """(where, row number, row as a dict) of every row of a Parquet/Arrow file or save_to_disk folder."""
    n = 0
    for f in arrow_files(path):
        for batch in _record_batches(f, columns):
            for row in batch.to_pylist():
                yield f"{path}[{n}]", n, row
                n += 1
