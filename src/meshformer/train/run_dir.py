"""What a run may do with its output_dir, decided on rank 0 and told to every rank.

- One run at a time: rank 0 holds an exclusive lock on `{output_dir}/.lock` (released by the kernel when the
  process dies, so a restarted job gets it back); a second run refuses in one line naming the holder.
- Nothing is lost: a run replaces an earlier one (`overwrite_output_dir: true`) by moving it aside into
  `{output_dir}/.replaced-<time>/` once its own model is built and loaded, and deletes that copy only after
  saving its first checkpoint. A run that fails before then leaves the old run there, intact (restore it with
  `mv`); the next run says so.
- Resume picks the newest checkpoint that verifies in full and names the newer ones it skipped and why; it
  never restarts at step 0 over an existing metrics.jsonl (that needs overwrite_output_dir).
- Leftovers of killed saves (`step_N.tmp`, `step_N.old`) are removed at start.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path

from meshformer.checkpoint import store
from meshformer.errors import UserError

LOCK = ".lock"
RESTART_WAIT_S = 90  # how long a restarted attempt waits for its previous attempt's rank 0 to let go
REPLACED = ".replaced-"


def on_rank0(env, fn: Callable[[], object]):
    """Run `fn` on rank 0 only and return its result on every rank; a UserError there is raised on all ranks
    (the others would otherwise wait forever in the next collective)."""
    result, error = None, None
    if env.rank == 0:
        try:
            result = fn()
        except UserError as e:
            error = str(e)
    result, error = env.broadcast_object((result, error))
    if error is not None:
        raise UserError(error)
    return result


class RunDir:
    def __init__(self, out: Path, env, log: Callable[[str], None]):
        self.out, self.env, self.log = Path(out), env, log
        self._lock_fd: int | None = None
        self.aside: Path | None = None  # where the replaced run went, until the first save

    # ---- locking ------------------------------------------------------------------------------------------
    def lock(self) -> None:
        """Take the output_dir for this run (rank 0); refuse when another live run has it."""
        on_rank0(self.env, self._lock)

    def _lock(self) -> None:
        if self.out.exists() and not self.out.is_dir():
            raise UserError(f"output_dir={str(self.out)!r} is a file: give a directory")
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / LOCK
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        job = os.environ.get("TORCHELASTIC_RUN_ID", "")
        deadline = time.monotonic() + RESTART_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "another process"
                # A restart of this same torchrun job: the previous attempt's rank 0 may still be exiting.
                same_job = bool(job) and f'"job": "{job}"' in holder
                if not same_job or time.monotonic() > deadline:
                    os.close(fd)
                    raise UserError(
                        f"output_dir={str(self.out)!r} is in use by a running meshformer job ({holder}): wait "
                        f"for it, stop it, or choose another output_dir"
                    ) from None
                time.sleep(0.2)
        os.ftruncate(fd, 0)
        me = {"host": socket.gethostname(), "pid": os.getpid(), "since": _now(), "job": job}
        os.pwrite(fd, json.dumps(me).encode(), 0)
        self._lock_fd = fd
        for p in store.clean_leftovers(self.out):
            self.log(f"removed {p}, left by a save that was interrupted")
        for p in sorted(self.out.glob(REPLACED + "*")):
            self.log(
                f"note: {p} holds a run that an earlier overwrite moved aside and did not finish replacing; "
                f"restore it with `mv {p}/* {self.out}/` or delete it"
            )

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing releases the flock; the file stays (it is not proof of anything)
            self._lock_fd = None

    # ---- choosing the checkpoint --------------------------------------------------------------------------
    def resolve(self, path: str | Path) -> Path:
        """A checkpoint or run directory -> the checkpoint to load, verified; skipped ones are logged."""

        def pick():
            notes: list[str] = []
            found = store.resolve_checkpoint(path, notes)
            return str(found), notes

        found, notes = on_rank0(self.env, pick)
        for n in notes:
            self.log(n)
        return Path(found)

    def find_resume(self, mode: bool | str, load_checkpoint: str, overwrite: bool) -> Path | None:
        """The checkpoint to resume (weights, optimizer, step) or None to start at step 0.

        True: load_checkpoint if given, else this output_dir's newest good checkpoint. "auto" (restarts): this
        output_dir's newest good checkpoint if there is one; else None, and load_checkpoint (if any) then only
        provides the starting weights, as on the first attempt.
        """
        if not mode:
            return None
        if load_checkpoint and mode != "auto":
            return self.resolve(load_checkpoint)

        def pick():
            good, skipped = store.newest_good(self.out)
            notes = [f"skipped checkpoint {c}: {why}" for c, why in skipped]
            if good is None and not overwrite and mode != "auto":
                if skipped:
                    raise UserError(
                        f"resume_training: no usable checkpoint in {self.out} ("
                        + "; ".join(f"{c.name}: {w}" for c, w in skipped)
                        + "): set overwrite_output_dir: true to start over, or load_checkpoint: an earlier copy"
                    )
                if (self.out / "metrics.jsonl").exists():
                    raise UserError(
                        f"resume_training: {self.out} has metrics.jsonl but no checkpoint to resume from: set "
                        f"overwrite_output_dir: true to start over (the old run is kept until the new one "
                        f"saves), or choose another output_dir"
                    )
            return (str(good) if good else None), notes

        found, notes = on_rank0(self.env, pick)
        for n in notes:
            self.log(n)
        if found is None:
            self.log(f"resume_training: no checkpoint in {self.out} yet; starting from step 0")
        return Path(found) if found else None

    # ---- replacing an earlier run -------------------------------------------------------------------------
    def check_existing(self, resume_from: Path | None, overwrite: bool) -> bool:
        """True when an earlier run is here and this one will replace it (moved aside at `replace_old`)."""
        root = store.checkpoint_root(self.out).resolve()
        existing = bool(store.list_checkpoints(self.out)) or (self.out / "metrics.jsonl").exists()
        resuming_here = resume_from is not None and resume_from.resolve().parent == root
        if existing and not resuming_here and not overwrite:
            raise UserError(
                f"output_dir={str(self.out)!r} already holds a run (checkpoints or metrics.jsonl): "
                f"set resume_training: true to continue it, overwrite_output_dir: true to replace it, "
                f"or choose another output_dir"
            )
        return existing and not resuming_here

    def replace_old(self) -> None:
        """Move the earlier run aside (rank 0). Called once this run has built and loaded its model."""

        def move():
            aside = self.out / f"{REPLACED}{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
            aside.mkdir()
            for name in ("checkpoint", "metrics.jsonl", "memory.json", "run_summary.json", "profile"):
                if (self.out / name).exists():
                    (self.out / name).rename(aside / name)
            return str(aside)

        self.aside = Path(on_rank0(self.env, move))
        self.log(f"the earlier run in {self.out} is moved to {self.aside}; it is deleted when this run has saved")

    def saved(self) -> None:
        """A checkpoint of this run is complete: the replaced run is no longer needed."""
        if self.aside is not None:
            if self.env.rank == 0:
                shutil.rmtree(self.aside, ignore_errors=True)
            self.log(f"deleted the replaced run {self.aside}")
            self.aside = None


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
