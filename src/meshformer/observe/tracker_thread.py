"""One tracker on a thread of its own: the training loop only puts calls on a queue, so a tracker that is slow (a
network, a background service starting) or hangs never holds up a step. The tracker's first failure (its package
missing at run time, a directory it cannot write, an exception while logging, a queue it cannot keep up with) is
reported once as a warning; the tracker is dropped and training goes on."""

from __future__ import annotations

import contextlib
import queue
import threading
import time

# Rows a tracker may fall behind by before it is dropped: memory stays bounded even when a tracker hangs.
MAX_BEHIND = 10_000
_STOP = object()


class TrackerThread:
    def __init__(self, name: str, build, run, log, keep_id):
        """build(): the tracker's object (imports its package); run: observe/trackers.py's TrackerRun; log: the
        console's log; keep_id(name, run id): record the run id for a resumed run."""
        self.name, self.say, self.keep_id = name, log, keep_id
        self.calls: queue.Queue = queue.Queue(maxsize=MAX_BEHIND)
        self.failed = False
        self._warn_lock = threading.Lock()
        self.thread = threading.Thread(
            target=self._work, args=(build, run), name=f"meshformer-tracker-{name}", daemon=True
        )
        self.thread.start()

    def log(self, step: int, values: dict) -> None:
        self._put(("log", step, values))

    def finish(self, summary: dict | None) -> None:
        self._put(("finish", summary))
        self._put(_STOP)

    def abandon(self) -> None:
        """The run failed: mark the tracker's run failed (what it was given before stays)."""
        self._put(("abandon",))
        self._put(_STOP)

    def join(self, timeout: float) -> None:
        start = time.monotonic()
        self.thread.join(timeout)
        if self.thread.is_alive():
            self._warn(
                f"still writing after {time.monotonic() - start:.0f} s (tracker_config.finish_timeout); left behind"
            )

    def _put(self, call) -> None:
        if self.failed:
            return
        try:
            self.calls.put_nowait(call)
        except queue.Full:
            self._warn(f"fell {MAX_BEHIND} metrics rows behind the training steps; dropped")

    def _work(self, build, run) -> None:
        tracker = None
        try:
            tracker = build()
            run_id = tracker.open(run)
            if run_id is not None:
                self.keep_id(self.name, str(run_id))
            while (call := self.calls.get()) is not _STOP:
                if self.failed:
                    continue
                if call[0] == "log":
                    tracker.log(call[1], call[2])
                elif call[0] == "finish":
                    tracker.finish(call[1])
                else:
                    tracker.abandon()
        except BaseException as e:  # noqa: BLE001 (a tracker's failure of any kind must not reach training)
            self._warn(f"failed ({type(e).__name__}: {_first_line(e)}); it is off for the rest of this run")
            if tracker is not None:
                with contextlib.suppress(Exception):
                    tracker.abandon()

    def _warn(self, what: str) -> None:
        with self._warn_lock:
            if self.failed:
                return
            self.failed = True
        self.say(f"warning: tracker {self.name} {what}; training goes on (metrics.jsonl has every step)")


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else "no message"
