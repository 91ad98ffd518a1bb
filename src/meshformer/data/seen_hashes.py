"""The content hashes of the documents seen so far, on disk (SQLite, one primary-key table), so deduplicating a
corpus of tens of millions of documents needs a few megabytes of memory, not a set of every hash."""

from __future__ import annotations

import sqlite3
from pathlib import Path

CACHE_KIB = 32 << 10  # SQLite's page cache: what the table may hold in memory
_IN_CHUNK = 900  # keys per `IN (...)` query, under SQLite's oldest limit on bound parameters (999)


class SeenHashes:
    """`first_seen(keys)`: for each key of a batch, in order, whether it is new (True) or a repeat of one seen in
    this or an earlier batch (False); new keys are recorded."""

    def __init__(self, path: Path):
        path.unlink(missing_ok=True)  # a scan always starts from nothing: a killed one left a partial table
        self.db = sqlite3.connect(str(path), isolation_level=None)
        # The table is scratch for one run: no journal, no fsync; a crash just means scanning again.
        self.db.executescript(
            f"PRAGMA journal_mode=OFF; PRAGMA synchronous=OFF; PRAGMA cache_size=-{CACHE_KIB}; "
            "CREATE TABLE seen (h BLOB PRIMARY KEY) WITHOUT ROWID;"
        )

    def first_seen(self, keys: list[bytes]) -> list[bool]:
        known: set[bytes] = set()
        for i in range(0, len(keys), _IN_CHUNK):
            part = keys[i : i + _IN_CHUNK]
            query = f"SELECT h FROM seen WHERE h IN ({','.join('?' * len(part))})"
            known.update(row[0] for row in self.db.execute(query, part))
        new, fresh = [], []
        for k in keys:
            is_new = k not in known
            new.append(is_new)
            if is_new:
                known.add(k)  # a repeat later in the same batch is a duplicate too
                fresh.append((k,))
        self.db.execute("BEGIN")
        self.db.executemany("INSERT INTO seen VALUES (?)", fresh)
        self.db.execute("COMMIT")
        return new

    def close(self) -> None:
        self.db.close()
