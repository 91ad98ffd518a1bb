"""MindRecord files (MindSpore's `FileWriter` shards, MindSpore Transformers' `MindDataset`) read without MindSpore.

A shard (`x.mindrecord`, or `x.mindrecord0`, `x.mindrecord1`, ..., zero-padded past ten shards) as MindSpore 2.x
writes it (format version 3.0):
- a uint64 little-endian length n, then n bytes of JSON: `header_size`, `page_size`, `schema` (each field's type and
  shape; `blob_fields`, in the order a row stores them), `page` (each page's id, type and bytes used) and
  `shard_addresses`. Page k starts at header_size + k * page_size; the last one ends the file.
- a row's arrays and bytes (its blob) lie in a BLOB_DATA page: a uint64 little-endian length, then each blob field as
  a uint64 big-endian length and its data (a row with one blob field: the data alone). int32 and int64 arrays are
  compressed: a uint32 big-endian element count, 2 bits per element (most significant first) naming its width
  (0: 1 byte, 1: 2, 2: 4, 3: 8), then every element little-endian and signed in that width. Other types are raw.
- scalar fields are msgpack in RAW_DATA pages; training needs none, so they are only listed.
- `x.mindrecord.db` beside it (SQLite) is the index: table INDEXES gives each ROW_ID its blob page and offsets.

`mindspore.dataset.MindDataset(files, shuffle=False)` yields the files in the order given and each file's rows in
ROW_ID order, so that is sample i's order here. A sample is MindSpore Transformers' view of the row (its
LlamaForCausalLM.construct in training): inputs input_ids[:-1], targets input_ids[1:]; a `labels` column (fine-tuning:
input_ids with -100 on prompt and padding) drops the targets whose label is ignored.
"""

from __future__ import annotations

import itertools
import json
import mmap
import os
import re
import sqlite3
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from meshformer.data.protocol import Sample, identity
from meshformer.errors import UserError

FORMAT = "mindrecord"
# MindSpore Transformers' rule (CausalLanguageModelDataset._process_mindrecord_data): names ending in mindrecord[N].
MINDRECORD_NAME = re.compile(r"mindrecord\d*$")
ENCRYPTED_TRAILER = b"ENCRYPT"  # what mindspore.mindrecord appends to a file it encrypted (set_enc_key)
COMPRESSED_TYPES = {"int32", "int64"}
TOKEN_COLUMN, LABEL_COLUMN = "input_ids", "labels"
WIDTH_DTYPES = {1: np.dtype("<i1"), 2: np.dtype("<i2"), 4: np.dtype("<i4"), 8: np.dtype("<i8")}


class CorruptShard(Exception):
    """A shard's bytes contradict its header or index (raised where the path is not known; re-raised with it)."""


@dataclass(frozen=True)
class Field:
    name: str
    type: str
    shape: tuple | None  # None: no shape (a scalar, a string, or bytes)

    def __str__(self) -> str:
        return self.type if self.shape is None else f"{self.type}{list(self.shape)}"


class Shard:
    """One MindRecord file, memory-mapped: its schema and, per row, where its blob lies."""

    def __init__(self, path: Path):
        self.path = path
        size = _size_of(path)
        self.header = _read_header(path, size)
        schema = self.header["schema"][0]
        self.fields = {
            name: Field(name, spec["type"], tuple(spec["shape"]) if "shape" in spec else None)
            for name, spec in schema["schema"].items()
        }
        self.blob_fields = list(schema.get("blob_fields", []))
        self.starts, self.ends = _read_index(path, self.header, size)
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)

    def __len__(self) -> int:
        return len(self.starts)

    def layout(self) -> tuple:
        """What MindDataset requires every file it reads together to share: the schema and the page geometry."""
        return self.fields, self.blob_fields, self.header["header_size"], self.header["page_size"]

    def layout_text(self) -> str:
        columns = ", ".join(f"{n}: {f}" for n, f in self.fields.items())
        return f"columns {columns} in pages of {self.header['page_size']} bytes after {self.header['header_size']}"

    def has(self, name: str) -> bool:
        return name in self.fields

    def integers(self, row: int, name: str) -> np.ndarray:
        """Row `row`'s int32/int64 array `name`, as int64."""
        data = self._column(row, name)
        try:
            return decode_ints(data)
        except CorruptShard as e:
            raise UserError(f"{self.path}: row {row}, column {name}: {e}: the file is damaged, rewrite it") from None

    def lengths(self, name: str) -> np.ndarray:
        """Elements of the compressed integer array `name` in every row, read from the rows' headers alone."""
        pos = self.starts + 8
        if len(self.blob_fields) > 1:  # step over the columns stored before it, each a big-endian size + data
            for _ in self.blob_fields[: self.blob_fields.index(name)]:
                pos = pos + 8 + self._gather(pos, 8).view(">u8").ravel().astype(np.int64)
            pos = pos + 8
        return self._gather(pos, 4).view(">u4").ravel().astype(np.int64)

    def _gather(self, pos: np.ndarray, width: int) -> np.ndarray:
        """Bytes [pos, pos + width) of every row, one row each."""
        if len(pos) and int(pos.max()) + width > len(self._bytes):
            raise UserError(f"{self.path}: a row's columns run past the end of the file: the file is damaged")
        return np.ascontiguousarray(self._bytes[pos[:, None] + np.arange(width)])

    def _column(self, row: int, name: str) -> np.ndarray:
        start, end = int(self.starts[row]), int(self.ends[row])
        blob = self._bytes[start + 8 : end]
        if struct.unpack_from("<Q", self._map, start)[0] != len(blob):
            raise UserError(f"{self.path}: row {row}'s length disagrees with its index ({self.path}.db): rewrite it")
        if len(self.blob_fields) == 1:
            return blob
        pos = 0
        for blob_name in self.blob_fields:
            if pos + 8 > len(blob):
                break
            (size,) = struct.unpack_from(">Q", blob, pos)
            if blob_name == name:
                if pos + 8 + size <= len(blob):
                    return blob[pos + 8 : pos + 8 + size]
                break
            pos += 8 + size
        raise UserError(f"{self.path}: row {row} is cut short before its {name} column: the file is damaged")


def decode_ints(data: np.ndarray) -> np.ndarray:
    """An int32/int64 array as MindRecord's writer compressed it (module docstring), as int64."""
    if len(data) < 4:
        raise CorruptShard("shorter than its element count")
    n = int.from_bytes(data[:4].tobytes(), "big")
    bitmap_end = 4 + (n + 3) // 4
    if bitmap_end > len(data):
        raise CorruptShard(f"{n} elements announced, the width table is cut short")
    codes = np.unpackbits(data[4:bitmap_end]).reshape(-1, 2)[:n]
    widths = 1 << (codes[:, 0].astype(np.int64) * 2 + codes[:, 1])
    if bitmap_end + int(widths.sum()) != len(data):
        raise CorruptShard(f"{n} elements of {int(widths.sum())} bytes do not fill its {len(data) - bitmap_end}")
    values = data[bitmap_end:]
    if n and (widths == widths[0]).all():  # one width for the whole row (the usual case): a single view
        return values.view(WIDTH_DTYPES[int(widths[0])]).astype(np.int64)
    out = np.empty(n, dtype=np.int64)
    starts = np.cumsum(widths) - widths
    for width, dtype in WIDTH_DTYPES.items():
        at = np.flatnonzero(widths == width)
        if len(at):
            raw = np.ascontiguousarray(values[starts[at][:, None] + np.arange(width)])
            out[at] = raw.view(dtype).ravel()
    return out


def _size_of(path: Path) -> int:
    if not path.is_file():
        raise UserError(f"{path}: no such MindRecord file")
    return path.stat().st_size


def _read_header(path: Path, size: int) -> dict:
    """The shard's JSON header, checked against the file's size (a truncated copy is refused here)."""
    with open(path, "rb") as f:
        head = f.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        text = f.read(length) if 0 < length < size else b""
        f.seek(max(size - len(ENCRYPTED_TRAILER), 0))
        encrypted = f.read() == ENCRYPTED_TRAILER
    if encrypted:
        raise UserError(f"{path}: an encrypted MindRecord: decrypt it with MindSpore (mindspore.mindrecord) first")
    try:
        header = json.loads(text)
        header_size, page_size = int(header["header_size"]), int(header["page_size"])
        pages = [(int(p["page_id"]), int(p["page_size"])) for p in header["page"]]
        header["schema"][0]["schema"].items()
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        raise UserError(
            f"{path}: not a MindRecord shard (its header does not parse): name only MindSpore FileWriter output"
        ) from None
    needed = max((header_size + k * page_size + used for k, used in pages), default=header_size)
    if size < needed:
        raise UserError(
            f"{path}: truncated: its header lists pages up to byte {needed} but the file has {size}: copy it again"
        )
    return header


def _read_index(path: Path, header: dict, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Every row's blob as [start, end) byte offsets in the file, in ROW_ID order, from the `.db` index."""
    db = Path(f"{path}.db")
    if not db.is_file():
        raise UserError(f"{db} is missing: a MindRecord shard is read through the index FileWriter writes beside it")
    query = "SELECT PAGE_ID_BLOB, PAGE_OFFSET_BLOB, PAGE_OFFSET_BLOB_END FROM INDEXES ORDER BY ROW_ID"
    try:  # immutable: read-only, and no journal or lock file is made beside a user's data
        with sqlite3.connect(f"{db.resolve().as_uri()}?immutable=1", uri=True) as con:
            (rows,) = con.execute("SELECT COUNT(*) FROM INDEXES").fetchone()
            flat = np.fromiter(itertools.chain.from_iterable(con.execute(query)), dtype=np.int64, count=3 * rows)
    except (sqlite3.Error, ValueError, TypeError) as e:
        raise UserError(f"{db}: not a MindRecord index ({e}): rewrite the shard with FileWriter") from None
    page, offset, offset_end = flat.reshape(-1, 3).T
    base = int(header["header_size"]) + page * int(header["page_size"])
    starts, ends = base + offset, base + offset_end
    if rows and (ends.max() > size or (ends - starts < 8).any()):
        raise UserError(f"{path}: truncated or damaged: its index ({db.name}) points past its rows: copy it again")
    return starts, ends


class MindRecordDataset:
    """MindRecord rows as samples of seq_length + 1 tokens, in `MindDataset(files, shuffle=False)`'s order.

    Sample i's loss_mask is MindSpore Transformers' input mask, indexed by the target (data/protocol.py): with a
    `labels` column, target k is trained where labels[k] is not negative (its ignore id, -100) and must then equal
    input_ids[k]; with `pad_token_id`, targets whose *input* input_ids[k - 1] is the pad are dropped too (its
    `input_ids[:-1] != pad_token_id`). Rows longer than seq_length + 1 are cut, as MindSpore's model would refuse
    them; shorter rows are refused (MindSpore batches rows of one length)."""

    tokenizer_hash = vocab_size = tokenizer_file = None  # MindRecords carry no tokenizer: the config's is used
    has_splits = False  # every split reads all rows: validation needs files of its own (train/data.py refuses)

    def __init__(self, shards: list[Shard], seq_length: int, pad_token_id: int | None = None):
        self.shards, self.seq_length, self.pad_token_id = shards, seq_length, pad_token_id
        self._ends = np.cumsum([len(s) for s in shards])
        self.labelled = bool(shards) and shards[0].has(LABEL_COLUMN)  # open_mindrecord: one schema for all files
        self.masked = pad_token_id is not None or self.labelled
        self._state = None

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    @property
    def source(self) -> str:
        """Its files, for errors: the first and how many more."""
        more = len(self.shards) - 1
        return f"{self.shards[0].path}" + (f" and {more} more files" if more else "") if self.shards else "no files"

    def locate(self, i: int) -> tuple[Shard, int]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        k = int(np.searchsorted(self._ends, i, side="right"))
        return self.shards[k], i - (int(self._ends[k - 1]) if k else 0)

    def sample(self, i: int) -> Sample:
        shard, row = self.locate(i)
        ids = self._row(shard, row, TOKEN_COLUMN)
        if ids.min() < 0:
            raise UserError(f"{shard.path}: row {row} holds input_ids {int(ids.min())}: token ids are never negative")
        if not self.masked:
            return Sample(torch.from_numpy(ids))
        mask = np.ones(len(ids), dtype=bool)
        if self.labelled:
            labels = self._row(shard, row, LABEL_COLUMN)
            mask = labels >= 0
            if not np.array_equal(labels[mask], ids[mask]):
                k = int(np.flatnonzero(mask & (labels != ids))[0])
                raise UserError(
                    f"{shard.path}: row {row}: labels[{k}]={int(labels[k])} but input_ids[{k}]={int(ids[k])}: "
                    f"meshformer trains each position on the next input token, so labels must be input_ids with "
                    f"ignored positions negative (-100), as MindSpore Transformers writes them"
                )
        if self.pad_token_id is not None:
            mask[1:] &= ids[:-1] != self.pad_token_id
        return Sample(torch.from_numpy(ids), torch.from_numpy(mask))

    def _row(self, shard: Shard, row: int, name: str) -> np.ndarray:
        values, n = shard.integers(row, name), self.seq_length + 1
        if len(values) < n:
            raise UserError(
                f"{shard.path}: row {row} has {len(values)} {name}, fewer than seq_length + 1 = {n}: set "
                f"model.model_config.seq_length to at most {len(values) - 1}, or rewrite the files for this length"
            )
        return values[:n]

    def state_dict(self) -> dict:
        if self._state is None:  # the fingerprint reads samples: once per dataset
            self._state = identity(self, FORMAT)
        return self._state

    def describe(self) -> dict:
        """`meshformer data stats`: files, columns, and the input_ids tokens stored, read and cut."""
        lengths = np.concatenate([s.lengths(TOKEN_COLUMN) for s in self.shards])
        n = self.seq_length + 1
        columns = {name: str(f) for name, f in self.shards[0].fields.items()}
        return {
            "samples": len(self),
            "tokens": int(np.minimum(lengths, n).sum()),
            "tokens_stored": int(lengths.sum()),
            "rows_cut": int((lengths > n).sum()),
            "rows_too_short": int((lengths < n).sum()),
            "files": len(self.shards),
            "columns": columns,
            "labels": self.labelled,
        }


def dataset_files(dl, field: str) -> list[Path] | None:
    """The MindRecord files a MindDataset data_loader names, in MindSpore Transformers' order, or None when it names
    meshformer's own format (a dataset_dir with meta.json, or one holding no MindRecord files: its errors apply).

    As MindSpore Transformers: dataset_dir first (a folder walked for MINDRECORD_NAME files, their paths sorted; or one
    such file, which brings every shard its header lists), else dataset_files in the order given."""
    if dl.dataset_dir:
        root = Path(dl.dataset_dir)
        if root.is_dir():
            if (root / "meta.json").is_file():
                return None
            found = sorted(
                os.path.join(here, name)
                for here, _, names in os.walk(root)
                for name in names
                if MINDRECORD_NAME.search(name)
            )
            return [Path(p) for p in found] or None
        if root.is_file() and MINDRECORD_NAME.search(root.name):
            return shards_of(root)
        return None
    if dl.dataset_files:
        files = [Path(str(p)) for p in dl.dataset_files]
        for p in files:
            if not p.is_file():
                raise UserError(f"{field}.dataset_files: {p} is not a file: list the .mindrecord shards to read")
        return files
    return None


def shards_of(path: Path) -> list[Path]:
    """Every shard of the file set `path` belongs to, in its header's order (MindDataset given one file name)."""
    header = _read_header(path, _size_of(path))
    return [path.parent / Path(str(name)).name for name in header.get("shard_addresses") or [path.name]]


def open_mindrecord(files: list[Path], seq_length: int, field: str, pad_token_id: int | None = None):
    """The MindRecordDataset of these files; every file must hold an integer `input_ids` array column."""
    shards = [Shard(p) for p in files]
    for shard in shards[1:]:  # MindDataset refuses files whose metadata differ ("generated by the same script")
        if shard.layout() != shards[0].layout():
            raise UserError(
                f"{field}: {shard.path} has {shard.layout_text()} but {shards[0].path} has "
                f"{shards[0].layout_text()}: read files of one schema and page size together, as MindSpore does"
            )
    for shard in shards[:1]:
        for name in (TOKEN_COLUMN, LABEL_COLUMN):
            f = shard.fields.get(name)
            if f is None and name == TOKEN_COLUMN:
                raise UserError(
                    f"{shard.path}: no input_ids column (it has {', '.join(shard.fields) or 'none'}): {field} reads "
                    f"MindSpore Transformers' MindRecords, an int32 input_ids array of seq_length + 1 tokens per row"
                )
            if f is not None and (f.type not in COMPRESSED_TYPES or f.shape is None or len(f.shape) != 1):
                raise UserError(
                    f"{shard.path}: column {name} is {f}, not a one-dimensional int32/int64 array: "
                    f"write it with FileWriter schema {{'type': 'int32', 'shape': [-1]}}"
                )
    return MindRecordDataset(shards, seq_length, pad_token_id)
