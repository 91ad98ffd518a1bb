"""Batches built ahead of the step that needs them, by a few background threads (MindSpore's num_parallel_workers,
prefetch_size).

A batch is a pure function of its global batch index, so building it early changes neither the order nor the
samples: asked for batch b, the prefetcher hands over the one it built for b (or builds it now), forgets any it
built that are no longer ahead (a loss-spike rollback jumps), and queues b + 1 .. b + depth. At most `depth` batches
wait in memory. A worker's exception is raised, as it was raised there, by the `get` that needed the batch.
Threads, not processes: building a batch is memory-mapped reads and a few tensor copies, which release the GIL.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

T = TypeVar("T")


class Prefetcher(Generic[T]):
    def __init__(self, build: Callable[[int], T], depth: int, workers: int, limit: int | None = None):
        """`build(b)` makes batch b; `depth` batches ahead (0: build on the caller's thread, on demand), on
        min(workers, depth) threads; no batch at or past `limit` is built ahead."""
        self.build, self.depth, self.limit = build, depth, limit
        threads = min(max(workers, 1), depth)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="meshformer-data") if depth > 0 else None
        self._ahead: dict[int, Future] = {}

    def get(self, b: int) -> T:
        if self._pool is None:
            return self.build(b)
        pending = self._ahead.pop(b, None)
        # Batch b first, the queue after: a worker woken now would take the GIL from the step that waits for b.
        batch = self.build(b) if pending is None else pending.result()
        wanted = range(b + 1, b + 1 + self.depth if self.limit is None else min(b + 1 + self.depth, self.limit))
        for k in [k for k in self._ahead if k not in wanted]:
            self._ahead.pop(k).cancel()
        for k in wanted:
            if k not in self._ahead:
                self._ahead[k] = self._pool.submit(self.build, k)
        return batch

    def close(self) -> None:
        """Drop what was built ahead and stop the threads (a batch being built finishes first)."""
        if self._pool is not None:
            for f in self._ahead.values():
                f.cancel()
            self._ahead.clear()
            self._pool.shutdown(wait=True)
            self._pool = None
