"""Naming the rank that broke a collective: which one died, froze or hung, in meshformer's own words.

When a rank dies, its neighbours' collectives fail with "Connection reset by peer"; when one hangs, every
other rank waits until `comm_timeout` and fails with "Timed out waiting ... for recv". Neither error says
which rank, and torchrun's report names only the first process that exited. So every rank keeps a heartbeat
in the launcher's rendezvous store (torchrun's agent store, which outlives the workers): a daemon thread bumps
`beat/{rank}` every BEAT_S seconds, and the rank's host, pid and current step are registered beside it.

On a failure that is not a user error (`explain`), the failing rank writes what it saw under `failed/{rank}`,
then watches the heartbeats for STALE_S seconds:
- a rank whose heartbeat stopped is named as the culprit: died (its pid is gone), or stopped/frozen (the pid is
  there but sends nothing: SIGSTOP, a stalled node) when it ran on this host; "stopped answering" on another;
- if every heartbeat is alive, the ranks that did not report the failure are the hung ones: alive, but stuck
  outside the collective the others wait in.
A rank that failed on its own first (an exception of its own) is named with that exception.
The store connection is this module's own, with a short timeout: a diagnosis never waits for comm_timeout.
"""

from __future__ import annotations

import datetime
import os
import re
import socket
import threading
import time

import torch.distributed as dist

BEAT_S = 1.0  # heartbeat period
STALE_S = 4.0  # a heartbeat that has not moved for this long belongs to a dead or frozen process
STORE_TIMEOUT_S = 10.0


_ACTIVE: Peers | None = None  # this process's heartbeat (see Peers.connect)


class Peers:
    """Heartbeats and failure reports of every rank of one attempt, kept in the launcher's store."""

    def __init__(self, store, rank: int, world: int):
        self.store, self.rank, self.world = store, rank, world
        self.step = 0  # the training step this rank is in (set by the trainer, reported in diagnoses)
        self._stop = threading.Event()
        host = socket.gethostname()
        store.set(f"peer/{rank}", f"{host} {os.getpid()}")
        self._beat()
        self._thread = threading.Thread(target=self._run, name="meshformer-heartbeat", daemon=True)
        self._thread.start()

    @classmethod
    def connect(cls, rank: int, world: int) -> Peers | None:
        """This process's Peers (one per process, like its process group: tests build many layouts on one), over
        its own client of the launcher's store (MASTER_ADDR/MASTER_PORT); None without a launcher store."""
        global _ACTIVE
        if _ACTIVE is not None and (_ACTIVE.rank, _ACTIVE.world) == (rank, world):
            return _ACTIVE
        if _ACTIVE is not None:
            _ACTIVE.close()
        _ACTIVE = cls._connect(rank, world)
        return _ACTIVE

    @classmethod
    def _connect(cls, rank: int, world: int) -> Peers | None:
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not addr or not port or world < 2:
            return None
        try:
            store = dist.TCPStore(addr, int(port), is_master=False, timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))
        except (RuntimeError, ValueError, OSError):
            return None  # no diagnosis then; training does not depend on it
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        run = os.environ.get("TORCHELASTIC_RUN_ID", "run")
        return cls(dist.PrefixStore(f"meshformer/peers/{run}/{attempt}/", store), rank, world)

    def close(self) -> None:
        """Stop the heartbeat and wait for its thread: a thread still inside a store call when the interpreter
        exits ends the process with "terminate called without an active exception"."""
        global _ACTIVE
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=STORE_TIMEOUT_S)
        if _ACTIVE is self:
            _ACTIVE = None

    def _beat(self) -> None:
        self.store.set(f"beat/{self.rank}", f"{time.monotonic_ns()} {self.step}")

    def _run(self) -> None:
        while not self._stop.wait(BEAT_S):
            try:
                self._beat()
            except (RuntimeError, OSError):
                return  # the store is gone (its host died): nothing left to report to

    # ---- after a failure ----------------------------------------------------------------------------------
    def explain(self, error: BaseException) -> str | None:
        """One line naming the rank(s) that caused `error` on this rank, or None when no culprit is found."""
        try:
            return self._explain(error)
        except (RuntimeError, OSError, ValueError):
            return None  # the store itself is unreachable: the original error stands

    def _explain(self, error: BaseException) -> str | None:
        seen = _one_line(error)
        self.store.set(f"failed/{self.rank}", f"{self.step} {seen}")
        others = [r for r in range(self.world) if r != self.rank]
        first = self._beats(others)
        deadline = time.monotonic() + STALE_S
        gone: list[int] = []
        while time.monotonic() < deadline and not gone:
            if len(self._reported()) == self.world:  # every rank saw it fail: no single culprit
                return None
            gone = [r for r in others if self._local_state(r) in (None, "Z", "T", "t")]  # no need to wait
            time.sleep(0.2)
        if not gone:
            last = self._beats(others)
            gone = [r for r in others if last[r] is None or last[r] == first[r]]
        if gone:
            named = [self._describe(r, "stopped") for r in gone]
        else:
            named = [self._describe(r, "hung") for r in others if r not in self._reported()]
        if not named:
            return None
        return (
            f"{'; '.join(named)}. Rank {self.rank} (after step {self.step}) saw: {seen[:160]}. This attempt ends; "
            f"under torchrun --max-restarts with resume_training: auto the job restarts from the newest good checkpoint"
        )

    def _beats(self, ranks: list[int]) -> dict[int, str | None]:
        return {r: self._get(f"beat/{r}") for r in ranks}

    def _reported(self) -> set[int]:
        return {r for r in range(self.world) if self.store.check([f"failed/{r}"])}

    def _get(self, key: str) -> str | None:
        return self.store.get(key).decode() if self.store.check([key]) else None

    def _peer(self, r: int) -> tuple[str, int]:
        host, pid = (self._get(f"peer/{r}") or "? 0").split()
        return host, int(pid)

    def _local_state(self, r: int) -> str:
        """The process state of rank r when it runs on this host (see _process_state); "" when remote."""
        host, pid = self._peer(r)
        return _process_state(pid) if host == socket.gethostname() and pid > 0 else ""

    def _describe(self, r: int, how: str) -> str:
        host, pid = self._peer(r)
        beat = self._get(f"beat/{r}")
        step = f" (its last heartbeat: after step {beat.split()[1]})" if beat else ""
        own = self._get(f"failed/{r}")
        where = f"pid {pid} on {host}"
        if own is not None:  # it failed by itself, before or while the others noticed
            return f"rank {r} ({where}) failed: {own.split(' ', 1)[1][:200]}"
        if how == "hung":
            return f"rank {r} ({where}) is alive but hung{step}: it never reached the collective the others wait in"
        state = self._local_state(r)
        if state == "":
            return f"rank {r} ({where}) stopped answering{step} (no heartbeat for {STALE_S:g} s)"
        if state is None or state == "Z":
            return f"rank {r} ({where}) died{step}"
        if state in ("T", "t"):
            return f"rank {r} ({where}) is stopped{step} (SIGSTOP or a debugger): send SIGCONT or kill it"
        return f"rank {r} ({where}) is frozen{step}: alive but sends no heartbeat (py-spy dump --pid {pid})"


def _one_line(error: BaseException) -> str:
    """`Type: first line`, without gloo's source-location prefix ("[/path/pair.cc:537] ")."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    first = re.sub(r"^\[[^\]]*:\d+\]\s*", "", lines[0]) if lines else ""
    first = first.split(". ")[0]  # gloo adds advice that does not apply here
    return f"{type(error).__name__}: {first}".rstrip(": ")


def _process_state(pid: int) -> str | None:
    """The kernel's one-letter state of a local process (R, S, T, Z, ...), or None when it does not exist."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return "?"
        return "?"
