"""Writing the packed format as the tokens arrive: each split's `{split}.bin` (every document + EOS) and its
document start offsets, kept in a raw int64 file until the end (a corpus of tens of millions of documents would
not fit in a Python array), then written as `{split}.idx.npy` exactly as `np.save` writes it.

A writer reports its state (tokens and documents written) after every batch; a resumed run truncates both files
back to that state and carries on, so its output is byte for byte an uninterrupted run's.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

COPY_TOKENS = 4 << 20  # tokens moved at a time (validation tails, offsets, Megatron conversion)


class SplitWriter:
    """Appends documents to {split}.bin and their start offsets to {split}.idx.raw; `state` resumes one."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, eos: int, state: dict | None = None):
        self.path = directory / f"{split}.bin"
        self.raw_path = directory / f"{split}.idx.raw"
        self.idx_path = directory / f"{split}.idx.npy"
        self.dtype, self.eos = np.dtype(dtype), np.array([eos], dtype=dtype).tobytes()
        self.tokens = state["tokens"] if state else 0
        self.documents = state["documents"] if state else 0
        mode = "r+b" if state else "w+b"  # readable: move_tail reads tokens back
        self.fh, self.raw = self.path.open(mode), self.raw_path.open(mode)
        self._truncate(self.fh, self.tokens * self.dtype.itemsize)
        self._truncate(self.raw, self.documents * 8)

    @staticmethod
    def _truncate(fh, size: int) -> None:
        fh.truncate(size)
        fh.seek(size)

    def state(self) -> dict:
        self.fh.flush()
        self.raw.flush()
        return {"tokens": self.tokens, "documents": self.documents}

    def begin(self) -> int:
        """Start a document; returns its start offset."""
        self.raw.write(np.int64(self.tokens).tobytes())
        self.documents += 1
        return self.tokens

    def append(self, ids: np.ndarray) -> None:
        self.fh.write(ids.astype(self.dtype, copy=False).tobytes())
        self.tokens += len(ids)

    def end(self) -> None:
        self.fh.write(self.eos)
        self.tokens += 1

    def move_tail(self, start: int, fraction: float, to: SplitWriter) -> None:
        """End the open document (begun at `start`) by moving its last ceil(fraction * n) tokens, at least one
        each side, to `to` as a document of its own; documents of fewer than 2 tokens stay whole."""
        n = self.tokens - start
        if n >= 2:
            m = min(n - 1, math.ceil(n * fraction))
            self.fh.flush()
            to.begin()
            cut = self.tokens - m
            for a in range(cut, self.tokens, COPY_TOKENS):
                count = min(COPY_TOKENS, self.tokens - a) * self.dtype.itemsize
                to.fh.write(os.pread(self.fh.fileno(), count, a * self.dtype.itemsize))
            to.tokens += m
            to.end()
            self._truncate(self.fh, cut * self.dtype.itemsize)
            self.tokens = cut
        self.end()

    def close(self) -> dict:
        """Close the files and write {split}.idx.npy (the raw offsets file is removed)."""
        self.fh.close()
        self.raw.close()
        if self.documents == 0:
            np.save(self.idx_path, np.zeros(0, dtype=np.int64), allow_pickle=False)
        else:
            raw = np.memmap(self.raw_path, dtype="<i8", mode="r")
            out = np.lib.format.open_memmap(self.idx_path, mode="w+", dtype="<i8", shape=(self.documents,))
            for a in range(0, self.documents, COPY_TOKENS):
                out[a : a + COPY_TOKENS] = raw[a : a + COPY_TOKENS]
            out.flush()
            del out, raw
        self.raw_path.unlink()
        return {"tokens": self.tokens, "documents": self.documents}


def documents_of(directory: Path, split: str, dtype: np.dtype):
    """(start, end) token ranges and the token memmap of a finished split, for converting it."""
    tokens_path = directory / f"{split}.bin"
    tokens = np.memmap(tokens_path, dtype=dtype, mode="r") if tokens_path.stat().st_size else np.zeros(0, dtype)
    starts = np.load(directory / f"{split}.idx.npy", mmap_mode="r", allow_pickle=False)
    return tokens, starts


def write_megatron(directory: Path, split: str, dtype: np.dtype, prefix: Path) -> dict:
    """Copy a finished split into a Megatron indexed dataset PREFIX.bin/.idx, a document per packed document
    (its EOS included, as Megatron's preprocess_data.py --append-eod writes it)."""
    from meshformer.data.megatron.indexed import IndexedWriter

    tokens, starts = documents_of(directory, split, dtype)
    writer = IndexedWriter(prefix, dtype if dtype.itemsize == 2 else np.dtype(np.int32))  # Megatron has no uint32
    for a in range(0, len(starts), COPY_TOKENS):
        block = np.asarray(starts[a : a + COPY_TOKENS])
        ends = np.append(block[1:], starts[a + len(block)] if a + len(block) < len(starts) else len(tokens))
        for s, e in zip(block.tolist(), ends.tolist()):
            writer.add_document(tokens[s:e])
    return writer.finalize()
