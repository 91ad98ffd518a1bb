"""Stopping cleanly when asked, and never outliving the launcher.

Schedulers announce preemption with a signal (SIGTERM from Kubernetes, Slurm and torchrun; SIGUSR1 from Slurm's
`--signal`; SIGINT from a terminal). The handler only records it; at the next step boundary every rank learns
whether any rank was signalled (one small all-reduce), they all save a checkpoint and the run returns normally
(exit code 0), to be resumed with `resume_training: true` or `auto`. A grace timer ends the process if that
takes longer than `runner_config.preemption_grace_seconds` (a stuck collective must not outlast the scheduler's
patience; the last complete checkpoint is still there).

Before the first step (data opening, model build and load) and after the last save there is nothing to save:
a stop signal ends the command at once, exit 0 (`StopBeforeTraining`). A second SIGTERM or SIGINT, a second or
more after the first, exits at once in every phase.

Python runs a signal handler only when the main thread next executes bytecode, which a long C call (a read, a
save, a collective) delays without bound. So the C-level handler's wake-up byte (`signal.set_wakeup_fd`) is read
by a thread of its own, which starts the grace timer and counts repeats the moment the kernel delivers the signal.

Workers started by torchrun ask the kernel to kill them when their parent dies (PR_SET_PDEATHSIG): killing the
launcher with SIGKILL otherwise leaves workers waiting in a collective until comm_timeout.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import sys
import threading
import time

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
PR_SET_PDEATHSIG = 1
# Nothing is in flight before the first step: a main thread stuck in C that long is not waited for any more.
IDLE_EXIT_SECONDS = 10.0
# A scheduler that signals every process of a job and a launcher that forwards the same signal deliver it twice
# within moments; only a repeat this much later is a person (or scheduler) insisting.
REPEAT_AFTER_SECONDS = 1.0


class StoppedBeforeTraining(BaseException):  # noqa: N818  (not an error: the command ends with exit code 0)
    """A stop signal arrived while there was nothing to save; the CLI reports it and exits 0."""


class _Guard:
    """A stop-signal handler that is also told, from the watcher thread, the moment a signal is delivered."""

    grace = IDLE_EXIT_SECONDS

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict = {}
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # handlers can only be set from there
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
            _watch(self)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._previous:
            _unwatch(self)
        self._previous.clear()
        if self._timer is not None:
            self._timer.cancel()

    def _note(self, signum: int) -> bool:
        """Record the first stop signal and start the timer; True for the first one."""
        with self._lock:
            if self.received is not None:
                return False
            self.received = signal.Signals(signum).name
            self._timer = threading.Timer(self.grace, self._expired)
            self._timer.daemon = True
            self._timer.start()
            return True

    def _handle(self, signum, frame) -> None:
        self._note(signum)

    def _expired(self) -> None:
        raise NotImplementedError


class StopRequests(_Guard):
    """Records stop signals while installed; `agreed(env)` is the collective decision to stop now."""

    def __init__(self, grace_seconds: float, log=print):
        super().__init__()
        self.grace, self.log = grace_seconds, log

    def __enter__(self) -> StopRequests:
        _state["training"] = True
        return super().__enter__()

    def _expired(self) -> None:
        sys.stderr.write(
            f"meshformer: {self.received}: no clean stop within preemption_grace_seconds={self.grace:g}; exiting "
            f"(the newest complete checkpoint is kept)\n"
        )
        sys.stderr.flush()
        os._exit(1)

    def agreed(self, env) -> bool:
        """Collective: True on every rank when any rank was asked to stop."""
        return not env.all_ok(self.received is None)


class StopBeforeTraining(_Guard):
    """For a whole `train` command: outside the step loop (StopRequests) a stop signal ends it, exit 0.

    Before training began the main thread raises StoppedBeforeTraining from wherever it is; if a C call holds it
    past IDLE_EXIT_SECONDS the process exits 0 anyway (nothing trained, nothing to save). After the loop the
    command is only finishing: it is left to finish within the same bound."""

    def __enter__(self) -> StopBeforeTraining:
        _state["training"] = False
        return super().__enter__()

    def _handle(self, signum, frame) -> None:
        if self._note(signum) and not _state["training"]:
            raise StoppedBeforeTraining(f"{self.received}: stopped before the first step; nothing to save")

    def _expired(self) -> None:
        sys.stderr.write(f"meshformer: {self.received}: stopping now (no step in flight; nothing to save)\n")
        sys.stderr.flush()
        os._exit(0)


_state: dict = {"training": False, "watcher": None}


class _Watcher:
    def __init__(self) -> None:
        self.guards: list[_Guard] = []  # innermost last
        self.first_at: float | None = None
        self._read, self._write = socket.socketpair()
        self._write.setblocking(False)
        self._previous_fd = signal.set_wakeup_fd(self._write.fileno(), warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._run, name="meshformer-stop-signals", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                data = self._read.recv(64)
            except OSError:
                return
            if not data or 0 in data:  # close() asked us to end
                return
            for signum in data:
                if signum in {int(s) for s in STOP_SIGNALS}:
                    self._seen(signum)

    def _seen(self, signum: int) -> None:
        now = time.monotonic()
        if self.first_at is None:
            self.first_at = now
        elif signum != signal.SIGUSR1 and now - self.first_at >= REPEAT_AFTER_SECONDS:
            name = signal.Signals(signum).name
            sys.stderr.write(f"meshformer: {name} again: exiting now (the newest complete checkpoint is kept)\n")
            sys.stderr.flush()
            os._exit(128 + signum)
        if self.guards:
            self.guards[-1]._note(signum)

    def close(self) -> None:
        signal.set_wakeup_fd(self._previous_fd)
        with contextlib.suppress(OSError):
            self._write.send(b"\0")
        self._thread.join(timeout=2)
        self._read.close()
        self._write.close()


def _watch(guard: _Guard) -> None:
    if _state["watcher"] is None:
        _state["watcher"] = _Watcher()
    _state["watcher"].guards.append(guard)


def _unwatch(guard: _Guard) -> None:
    w = _state["watcher"]
    if w is None:
        return
    w.guards.remove(guard)
    if not w.guards:
        _state["watcher"] = None
        w.close()


@contextlib.contextmanager
def stop_signals_held():
    """Ignore stop signals for a moment (naming a failed rank after a collective broke): the launcher's SIGTERM
    to the survivors would otherwise end them before they say which rank failed. Its SIGKILL still ends them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def die_with_parent() -> bool:
    """Under torchrun, have the kernel SIGKILL this worker when its launcher dies. Returns whether it was set."""
    if "TORCHELASTIC_RUN_ID" not in os.environ and "LOCAL_RANK" not in os.environ:
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() == 1:  # the launcher died before we asked: go now rather than linger
        os._exit(1)
    return True
