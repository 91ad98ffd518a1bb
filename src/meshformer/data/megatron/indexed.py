"""Megatron indexed dataset files (`PREFIX.bin` tokens, `PREFIX.idx` index): reading by memory map, writing.

The `.idx` layout (megatron/core/datasets/indexed_dataset.py, version 1): the 9-byte magic `MMIDIDX\\x00\\x00`,
`<Q` version, `<B` dtype code, `<Q` sequence count, `<Q` document-index count (documents + 1), then int32
sequence lengths, int64 byte pointers into `.bin`, int64 document indices (sequence ids starting each document,
0 first and the sequence count last). `.bin` is the tokens of every sequence back to back. `IndexedFile` maps both
without copying; `IndexedWriter` streams tokens to `.bin` and writes the index at the end, both into temporary
siblings renamed into place, so a killed run leaves no half-written dataset under the prefix.
"""

from __future__ import annotations

import os
import struct
from array import array
from pathlib import Path

import numpy as np

from meshformer.errors import UserError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8
DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(t): code for code, t in DTYPE_CODES.items()}
TOKEN_DTYPES = tuple(np.dtype(t) for t in (np.uint8, np.uint16, np.int16, np.int32, np.int64))


def bin_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.bin")


def idx_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.idx")


class IndexedFile:
    """One `PREFIX.bin`/`.idx` pair, memory-mapped: `sequence_lengths`, `sequence_pointers`, `document_indices`
    (views into the index file) and `get(i, offset, length)`, the tokens of sequence i (a view into `.bin`)."""

    def __init__(self, prefix: str | Path):
        self.prefix = str(prefix)
        idx, bin_ = idx_path(prefix), bin_path(prefix)
        for f in (idx, bin_):
            if not f.is_file():
                raise UserError(f"{f}: no such file: give the prefix of a Megatron .bin/.idx pair (without suffix)")
        self.dtype, seqs, docs = _read_header(idx)
        need = HEADER_BYTES + seqs * (4 + 8) + docs * 8
        if idx.stat().st_size < need:
            raise UserError(
                f"{idx}: truncated ({idx.stat().st_size} bytes, its header promises {need}): "
                f"re-create the dataset (`meshformer preprocess --format megatron`)"
            )
        raw = np.memmap(idx, dtype=np.uint8, mode="r")
        self.sequence_lengths = np.frombuffer(raw, np.int32, seqs, HEADER_BYTES)
        self.sequence_pointers = np.frombuffer(raw, np.int64, seqs, HEADER_BYTES + 4 * seqs)
        self.document_indices = np.frombuffer(raw, np.int64, docs, HEADER_BYTES + 12 * seqs)
        self._check_index(idx, seqs, docs)
        self._tokens = self._map_tokens(bin_)

    def _check_index(self, idx: Path, seqs: int, docs: int) -> None:
        d = self.document_indices
        if docs < 1 or d[0] != 0 or d[-1] != seqs or (docs > 1 and bool((np.diff(d) < 0).any())):
            raise UserError(f"{idx}: damaged document index (not 0 ... {seqs}, ascending): re-create the dataset")
        if seqs and int(self.sequence_lengths.min()) < 0:
            raise UserError(f"{idx}: damaged (a negative sequence length): re-create the dataset")

    def _map_tokens(self, bin_: Path) -> np.ndarray:
        size, item = bin_.stat().st_size, self.dtype.itemsize
        bad = _first_outside(self.sequence_pointers, self.sequence_lengths, item, size)
        if bad is not None:
            i, pointer, length = bad
            raise UserError(
                f"{bin_}: truncated or damaged ({size} bytes): its .idx puts sequence {i} ({length} tokens) at byte "
                f"{pointer}, outside it: re-create the dataset or copy the .bin again"
            )
        if size < item:
            return np.zeros(0, self.dtype)
        return np.memmap(bin_, dtype=self.dtype, mode="r", shape=(size // item,))

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence i (to its end when length is None), without a copy."""
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        n = int(self.sequence_lengths[i]) - offset if length is None else length
        return self._tokens[start : start + n]

    def gather(self, sequences: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Tokens [offset, offset + length) of each sequence, concatenated (one fancy-index read), as int64."""
        if len(sequences) == 1:
            return self.get(int(sequences[0]), int(offsets[0]), int(lengths[0])).astype(np.int64)
        first = self.sequence_pointers[sequences] // self.dtype.itemsize + offsets
        ends = np.cumsum(lengths)
        positions = np.arange(int(ends[-1]) if len(ends) else 0) + np.repeat(first - (ends - lengths), lengths)
        return self._tokens[positions].astype(np.int64)


def _first_outside(pointers: np.ndarray, lengths: np.ndarray, item: int, size: int, chunk: int = 1 << 22):
    """(i, pointer, length) of the first sequence that does not lie within the .bin's `size` bytes at an item
    boundary, else None. Every sequence is checked (a damaged pointer in the middle would read past the map much
    later, mid-training), in chunks, so a file of a hundred million sequences needs no copy of its index."""
    for lo in range(0, len(pointers), chunk):
        p = np.asarray(pointers[lo : lo + chunk])
        n = np.asarray(lengths[lo : lo + chunk]).astype(np.int64)
        # pointer > size first: a pointer near 2**63 would overflow when its length is added
        bad = (p < 0) | (p > size) | (p % item != 0)
        bad |= np.minimum(p, size) + n * item > size
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            return lo + k, int(p[k]), int(n[k])
    return None


def _read_header(idx: Path) -> tuple[np.dtype, int, int]:
    with open(idx, "rb") as f:
        head = f.read(HEADER_BYTES)
    if len(head) < HEADER_BYTES:
        raise UserError(f"{idx}: truncated ({len(head)} bytes, shorter than the {HEADER_BYTES}-byte header)")
    if head[: len(MAGIC)] != MAGIC:
        raise UserError(f"{idx}: not a Megatron index (no MMIDIDX header): give a .bin/.idx prefix")
    version, code, seqs, docs = struct.unpack_from("<QBQQ", head, len(MAGIC))
    if version != VERSION:
        raise UserError(f"{idx}: index version {version}, only version {VERSION} is read")
    if code not in DTYPE_CODES:
        raise UserError(f"{idx}: unknown token dtype code {code} (known: {sorted(DTYPE_CODES)}): damaged file")
    return np.dtype(DTYPE_CODES[code]), seqs, docs


class IndexedWriter:
    """Writes `PREFIX.bin` and `PREFIX.idx` that megatron-core's IndexedDataset reads: one sequence per document,
    tokens streamed to disk as they come (the index keeps 4 bytes per document in memory)."""

    def __init__(self, prefix: Path, dtype: np.dtype, overwrite: bool = False):
        self.prefix, self.dtype = Path(prefix), np.dtype(dtype)
        if self.dtype not in TOKEN_DTYPES:
            raise UserError(
                f"Megatron token dtype {self.dtype} is not an integer dtype Megatron reads: use uint16/int32"
            )
        self.bin, self.idx = bin_path(prefix), idx_path(prefix)
        existing = [str(p) for p in (self.bin, self.idx) if p.exists()]
        if existing and not overwrite:
            raise UserError(f"{existing[0]} already exists: choose another output prefix or remove it first")
        self._tmp_bin = self.bin.with_name(self.bin.name + ".tmp")
        self._tmp_idx = self.idx.with_name(self.idx.name + ".tmp")
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        self._out = open(self._tmp_bin, "wb")
        self._lengths = array("i")
        info = np.iinfo(self.dtype)
        self._range = (int(info.min), int(info.max))

    def add_document(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids)
        if (
            ids.size
            and not np.can_cast(ids.dtype, self.dtype)
            and (int(ids.min()) < self._range[0] or int(ids.max()) > self._range[1])
        ):
            raise UserError(
                f"{self.bin}: token id {int(ids.max())} does not fit {self.dtype} (max {self._range[1]}): "
                f"write the dataset with a wider dtype (int32)"
            )
        self._out.write(ids.astype(self.dtype, copy=False).tobytes(order="C"))
        self._lengths.append(ids.size)

    def finalize(self) -> dict:
        """Write the index, move both files into place; {"tokens": ..., "documents": ...}."""
        self._out.close()
        lengths = np.frombuffer(self._lengths, dtype=np.int32) if self._lengths else np.zeros(0, np.int32)
        pointers = np.zeros(len(lengths), np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        with open(self._tmp_idx, "wb") as f:
            f.write(MAGIC + struct.pack("<QBQQ", VERSION, CODE_OF_DTYPE[self.dtype], len(lengths), len(lengths) + 1))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(np.arange(len(lengths) + 1, dtype=np.int64).tobytes())
        os.replace(self._tmp_bin, self.bin)
        os.replace(self._tmp_idx, self.idx)
        return {"tokens": int(lengths.sum(dtype=np.int64)), "documents": len(lengths)}

    def abort(self) -> None:
        """Drop what was written (the temporary files); the prefix is left as it was."""
        self._out.close()
        for f in (self._tmp_bin, self._tmp_idx):
            f.unlink(missing_ok=True)

    def __enter__(self) -> IndexedWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
