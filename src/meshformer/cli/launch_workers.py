"""torchrun's agent run inside `meshformer launch`, so the launcher owns its workers (cli/launch_cmd.py).

Stop signals are forwarded to the workers rather than left to the agent: torchrun's own handler raises
SignalException, stops the workers itself and exits 1 with a traceback even when every worker saved and exited 0.
The workers (torchrun starts each in a session of its own) are this process's children, found in /proc.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from meshformer.errors import RunFailed
from meshformer.train.preemption import STOP_SIGNALS, StoppedBeforeTraining

# A worker stuck where its own grace timer cannot run (a C call holding the GIL) is killed this much later.
BACKSTOP_SECONDS = 15.0


def children(pid: int, zombies: bool = False) -> list[int]:
    """The child processes of pid, live ones only unless `zombies` (ppid is the 4th field of /proc/N/stat, after
    the parenthesised name)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields and (zombies or fields[0] != "Z") and int(fields[1]) == pid:
            found.append(int(d.name))
    return found


class StderrOnce:
    """fd 2 of this process (and so of the workers, which inherit it) becomes a pipe; a thread copies it to the
    real stderr, printing each distinct `meshformer:` line once: every rank reports the same bad input."""

    def __init__(self) -> None:
        self.saw_error = False
        self._seen: set[str] = set()

    def __enter__(self) -> StderrOnce:
        sys.stderr.flush()
        self._real = os.dup(2)
        read, write = os.pipe()
        os.dup2(write, 2)
        os.close(write)
        self._thread = threading.Thread(target=self._copy, args=(read,), name="meshformer-stderr", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        sys.stderr.flush()
        os.dup2(self._real, 2)  # closes our end of the pipe: the copy ends once no worker holds it
        self._thread.join(timeout=5)
        os.close(self._real)

    def _copy(self, read: int) -> None:
        pending = b""
        with contextlib.suppress(OSError):
            while chunk := os.read(read, 65536):
                *lines, pending = (pending + chunk).split(b"\n")
                self._write(b"".join(line + b"\n" for line in lines if self._keep(line)))
        with contextlib.suppress(OSError):
            if pending and self._keep(pending):
                self._write(pending)
        os.close(read)

    def _keep(self, line: bytes) -> bool:
        text = line.decode(errors="replace").rstrip()
        if not text.startswith("meshformer: "):
            return True
        self.saw_error |= text.startswith("meshformer: error: ")
        if text in self._seen:
            return False
        self._seen.add(text)
        return True

    def _write(self, data: bytes) -> None:
        while data:
            data = data[os.write(self._real, data) :]


class Forwarder:
    """SIGTERM/SIGINT/SIGUSR1 to every worker; before any worker exists, the launch just ends (exit 0)."""

    def __init__(self, grace_seconds: float) -> None:
        self.grace = grace_seconds
        self.sent: int | None = None
        self._previous: dict = {}
        self._backstop: threading.Timer | None = None

    def __enter__(self) -> Forwarder:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._forward)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._backstop is not None:
            self._backstop.cancel()

    def _forward(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        workers = children(os.getpid())
        if not workers and not children(os.getpid(), zombies=True):  # dead, unreaped workers: their failure counts
            raise StoppedBeforeTraining(f"{name}: stopped before the workers started; nothing to save")
        if self.sent is None:
            self.sent = signum
            self._backstop = threading.Timer(self.grace + BACKSTOP_SECONDS, self._kill, args=(name,))
            self._backstop.daemon = True
            self._backstop.start()
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    def _kill(self, name: str) -> None:
        os.write(
            2,
            f"meshformer: {name}: workers still running {self.grace + BACKSTOP_SECONDS:g} s later: killed "
            f"(the newest complete checkpoint is kept)\n".encode(),
        )
        kill_workers()


def kill_workers() -> None:
    for pid in children(os.getpid()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def supervise(torchrun_args: list[str], grace_seconds: float) -> int:
    """Run torchrun's agent on `torchrun_args` here; the exit code follows the workers (see the module doc)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args
    from torch.distributed.run import run as torchrun

    ns = parse_args(torchrun_args)
    ns.signals_to_handle = os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGHUP,SIGQUIT"  # the rest: Forwarder
    for name in ("torch.distributed.elastic", "torch.distributed.run"):  # its report is replaced by ours
        logging.getLogger(name).setLevel(logging.CRITICAL)
    with StderrOnce() as err, Forwarder(grace_seconds) as fwd:
        try:
            torchrun(ns)
            return 0
        except StoppedBeforeTraining as e:
            kill_workers()  # any that were just starting: nothing of theirs to save
            print(f"meshformer: {e}", flush=True)
            return 0
        except SignalException as e:  # SIGHUP / SIGQUIT: torchrun stopped the workers
            raise RunFailed(f"{e.sigval.name}: the workers were stopped") from None
        except ChildFailedError as e:
            codes = {rank: f.exitcode for rank, f in sorted(e.failures.items())}
    if fwd.sent is not None and all(c == -fwd.sent for c in codes.values()):
        # signalled before their handlers were in place (interpreter start): they had nothing to save
        print(f"meshformer: {signal.Signals(fwd.sent).name}: stopped before the first step; nothing to save")
        return 0
    if fwd.sent is not None and all(c > 128 for c in codes.values()):
        return max(codes.values())  # a repeated stop signal: the workers exited at once and said so
    if 2 in codes.values():
        return 2  # a worker found a bad input and said so (once, above)
    if err.saw_error:
        return 1
    rank, code = next(iter(codes.items()))
    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
    raise RunFailed(f"rank {rank} {how}; its output is above")
