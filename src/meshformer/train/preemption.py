"""Stopping cleanly when asked, and never outliving the launcher.

Schedulers announce preemption with a signal (SIGTERM from Kubernetes, Slurm and torchrun; SIGUSR1 from Slurm's
`--signal`; SIGINT from a terminal). The handler only records it; at the next step boundary every rank learns
whether any rank was signalled (one small all-reduce), they all save a checkpoint and the run returns normally
(exit code 0), to be resumed with `resume_training: true` or `auto`. A grace timer ends the process if that
takes longer than `runner_config.preemption_grace_seconds` (a stuck collective must not outlast the scheduler's
patience; the last complete checkpoint is still there).

Workers started by torchrun ask the kernel to kill them when their parent dies (PR_SET_PDEATHSIG): killing the
launcher with SIGKILL otherwise leaves workers waiting in a collective until comm_timeout.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
PR_SET_PDEATHSIG = 1


class StopRequests:
    """Records stop signals while installed; `agreed(env)` is the collective decision to stop now."""

    def __init__(self, grace_seconds: float, log=print):
        self.grace, self.log = grace_seconds, log
        self.received: str | None = None
        self._previous: dict = {}
        self._timer: threading.Timer | None = None

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():  # handlers can only be set from there
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._timer is not None:
            self._timer.cancel()

    def _handle(self, signum, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: the user does not want to wait for the save
        self.received = signal.Signals(signum).name
        if self._timer is None:
            self._timer = threading.Timer(self.grace, self._expired)
            self._timer.daemon = True
            self._timer.start()

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
