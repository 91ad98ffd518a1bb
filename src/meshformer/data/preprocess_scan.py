"""Pass 1 of `preprocess`: every document's fate (skipped, training, validation) from the hash of its
whitespace-stripped text, streamed: one byte per document in `decisions.bin` and the hashes in SQLite
(seen_hashes.py), so neither grows in memory with the corpus.

A document goes to validation when its hash falls below val_fraction, so the choice is deterministic,
independent of input order, and exact duplicates share a split (preprocess.py says how the mode is chosen).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

from meshformer.data.documents import iter_document_pieces
from meshformer.data.seen_hashes import SeenHashes
from meshformer.data.sources import stripped

SKIP, TRAIN, VAL = 0, 1, 2
HASH_BATCH = 4096  # documents whose hashes are looked up in one query
DECISIONS = "decisions.bin"


def _content_hash(pieces) -> bytes | None:
    """sha256 of the document's stripped UTF-8 text, or None when it is only whitespace."""
    h, empty = hashlib.sha256(), True
    for part in stripped(pieces):
        h.update(part.encode("utf-8"))
        empty = False
    return None if empty else h.digest()


def scan(paths, text_field: str, text_split: str, val_fraction: float, keep_duplicates: bool, scratch: Path) -> dict:
    """Write scratch/decisions.bin; returns the counts (read, empty, duplicates, kept, validation)."""
    counts = {"read": 0, "empty": 0, "duplicates": 0, "kept": 0, "validation": 0}
    threshold = int(val_fraction * 2.0**64)
    seen = SeenHashes(scratch / "seen.sqlite")
    pending: list[bytes | None] = []

    def flush(out) -> None:
        keys = [h[:16] for h in pending if h is not None]
        new = iter(seen.first_seen(keys))
        decided = bytearray()
        for h in pending:
            if h is None:
                decided.append(SKIP)
                continue
            if not next(new):
                counts["duplicates"] += 1
                if not keep_duplicates:
                    decided.append(SKIP)
                    continue
            decided.append(VAL if int.from_bytes(h[16:24], "little") < threshold else TRAIN)
        counts["kept"] += len(decided) - decided.count(SKIP)
        counts["validation"] += decided.count(VAL)
        out.write(decided)
        pending.clear()

    try:
        with (scratch / DECISIONS).open("wb") as out:
            for _, pieces in iter_document_pieces(paths, text_field, text_split):
                counts["read"] += 1
                h = _content_hash(pieces)
                counts["empty"] += h is None
                pending.append(h)
                if len(pending) >= HASH_BATCH:
                    flush(out)
            flush(out)
    finally:
        seen.close()
    (scratch / "seen.sqlite").unlink(missing_ok=True)
    return counts


def decisions(scratch: Path, block: int = 1 << 20) -> Iterator[int]:
    """The decisions pass 1 wrote, in document order."""
    with (scratch / DECISIONS).open("rb") as fh:
        while chunk := fh.read(block):
            yield from chunk
