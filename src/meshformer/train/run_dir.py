"""What a run may do with its output_dir, decided on rank 0 and told to every rank.

- One run at a time: rank 0 holds an exclusive lock on `{output_dir}/.lock` (released by the kernel when the
  process dies, so a restarted job gets it back); a second run refuses in one line naming the holder. An
  output_dir this process cannot write (permissions, a read-only filesystem) is refused there, before anything.
- Nothing is lost: a run replaces an earlier one (`overwrite_output_dir: true`, or `auto` after an attempt that
  died before its first save) by moving meshformer's own files (`own_files`) aside into
  `{output_dir}/.replaced-<time>-<pid>/` once its own model is built and loaded; a user's files stay where they
  are. That copy is deleted, file by file as it was moved, only after this run saved its first checkpoint. A run
  that fails before then leaves the old run there, intact; the next run says so and how to restore it.
- Resume picks the newest checkpoint that verifies in full and names the newer ones it skipped and why; it
  never restarts at step 0 over checkpoints that are all unusable, nor (`true`) over an existing metrics.jsonl:
  that needs overwrite_output_dir.
- Leftovers of killed saves (`step_N.tmp`, `step_N.old`) are removed at start.
- A checkpoint that fails verification is never deleted: before the first step (model built and loaded, like the
  move above) it is renamed `step_N.damaged` (store.set_aside), out of reach of saves, pruning and replacement.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from meshformer.checkpoint import store
from meshformer.checkpoint.manifest import verify
from meshformer.errors import UserError
from meshformer.observe.journal import SUMMARY
from meshformer.observe.trackers import IDS_FILE

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
        self.moved: list[str] = []  # what went there, relative to output_dir and to aside alike
        self.damaged: dict[str, str] = {}  # rank 0: checkpoints resume skipped (verified in full) -> why

    # ---- locking ------------------------------------------------------------------------------------------
    def lock(self) -> None:
        """Take the output_dir for this run (rank 0); refuse when another live run has it."""
        on_rank0(self.env, self._lock)

    def _lock(self) -> None:
        try:
            if self.out.exists() and not self.out.is_dir():
                raise UserError(f"output_dir={str(self.out)!r} is a file: give a directory")
            self.out.mkdir(parents=True, exist_ok=True)
            # An existing .lock opens even in a directory that refuses new files: probe with a file of our own.
            probe_fd, probe = tempfile.mkstemp(prefix=".meshformer-probe-", dir=self.out)
            os.close(probe_fd)
            os.unlink(probe)
            fd = os.open(self.out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise UserError(
                f"output_dir={str(self.out)!r} is not writable ({e.strerror or e}): choose an output_dir on a "
                f"writable filesystem, or give this user write permission there"
            ) from None
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
                f"restore it with `cp -a {p}/. {self.out}/ && rm -r {p}` or delete it"
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
        if load_checkpoint and mode != "auto" and Path(load_checkpoint).resolve() != self.out.resolve():
            return self.resolve(load_checkpoint)

        def pick():
            good, skipped = store.newest_good(self.out)
            # said once, when they are set aside (set_aside_damaged); a refusal below names them itself
            self.damaged = {str(c): why for c, why in skipped}
            notes: list[str] = []
            if good is None and not overwrite:
                # Checkpoints that are all unusable may still be repaired (intact shards, an earlier copy):
                # starting over would move them aside and delete them after the first save.
                if skipped:
                    raise UserError(
                        f"resume_training: {str(mode).lower()}: no usable checkpoint in {self.out} ("
                        + "; ".join(f"{c.name}: {w}" for c, w in skipped)
                        + "): nothing was changed; repair or remove them, set overwrite_output_dir: true to start "
                        "over (the old run is kept until the new one saves), or choose another output_dir"
                    )
                # auto: metrics.jsonl without any checkpoint is an attempt that died before its first save,
                # replaced (moved aside, deleted after this run's first save) like overwrite_output_dir does.
                if mode != "auto" and (self.out / "metrics.jsonl").exists():
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

    # ---- damaged checkpoints ------------------------------------------------------------------------------
    def set_aside_damaged(self) -> None:
        """Before the first step: rename every checkpoint of output_dir that fails verification to
        `step_N.damaged`, one warning line each (where, and why), so that no save of that step, no pruning and no
        replacement of the run can delete it. The ones resume skipped were verified in full; the others get the
        quick check (manifest, sizes, shard headers: no hashing), as pruning does."""

        def move():
            notes = []
            for ckpt in store.list_checkpoints(self.out):
                why = self.damaged.get(str(ckpt)) or verify(ckpt, full=False)
                if why is not None:
                    notes.append(set_aside_line(ckpt, why))
            self.damaged = {}
            return notes

        for note in on_rank0(self.env, move):
            self.log(note)

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

    def replace_old(self, tensorboard_dir: str = "") -> None:
        """Move the earlier run's own files aside (rank 0), keeping everything else in output_dir. Called once
        this run has built and loaded its model. A move that fails puts back what had moved and refuses."""

        def move():
            moved: list[str] = []
            # mkdtemp: a unique name even for two replacing runs of one process within a second
            aside = self.out / f"{REPLACED}{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
            try:
                aside = Path(tempfile.mkdtemp(prefix=f"{aside.name}-", dir=self.out))
                for rel in own_files(self.out, tensorboard_dir):
                    (aside / rel).parent.mkdir(parents=True, exist_ok=True)
                    (self.out / rel).rename(aside / rel)
                    moved.append(rel)
            except BaseException as e:  # a stop signal too: never leave the old run half moved
                for rel in reversed(moved):
                    (aside / rel).rename(self.out / rel)
                if aside.is_dir():
                    _remove_empty_dirs(aside)
                if not isinstance(e, OSError):
                    raise
                raise UserError(
                    f"output_dir={str(self.out)!r}: could not move the earlier run aside ({e.strerror or e}: "
                    f"{e.filename}); it is as it was: make output_dir writable (one filesystem), or choose another "
                    f"output_dir"
                ) from None
            return str(aside), moved

        aside, self.moved = on_rank0(self.env, move)
        self.aside = Path(aside)
        self.log(
            f"the earlier run in {self.out} ({len(self.moved)} of meshformer's files or checkpoints; other files "
            f"stay) is moved to {self.aside}; it is deleted when this run has saved"
        )

    def saved(self) -> None:
        """A checkpoint of this run is complete: the replaced run is no longer needed. Only what `replace_old`
        moved is deleted; anything else found in the copy (put there since) stays, and the log says so."""
        if self.aside is None:
            return

        def delete():
            for rel in self.moved:
                p = self.aside / rel
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):  # already gone, or not ours to force: it stays
                        p.unlink()
            with contextlib.suppress(OSError):
                _remove_empty_dirs(self.aside)
            return self.aside.exists()

        if on_rank0(self.env, delete):
            self.log(
                f"deleted the replaced run from {self.aside}; it stays: it holds files this run did not move there"
            )
        else:
            self.log(f"deleted the replaced run {self.aside}")
        self.aside = None


def set_aside_line(ckpt: Path, why: str) -> str:
    """Set a damaged checkpoint aside (store.set_aside) and return the warning that says where it went and why."""
    try:
        where = store.set_aside(ckpt)
    except OSError as e:
        raise UserError(
            f"checkpoint {ckpt} is damaged ({why}) and could not be set aside ({e.strerror or e}); nothing of it "
            f"was changed: move it out of {ckpt.parent} yourself (it may be repairable), or make it writable"
        ) from None
    return (
        f"warning: skipped checkpoint {ckpt}: {why}; it is set aside as {where} (kept for repair: no save, pruning "
        f"or overwrite deletes it)"
    )


def own_files(out: Path, tensorboard_dir: str = "") -> list[str]:
    """What an earlier run wrote into `out`, relative to it: checkpoint/step_N directories, metrics.jsonl,
    memory.json, run_summary.json, trackers.json (the trackers' run ids), the profiler's files, and TensorBoard
    event files when tensorboard_dir lies inside `out`. Nothing else there is meshformer's (a user's notes, a file
    inside checkpoint/), so a replacing run leaves it in place."""
    rels = [c.relative_to(out).as_posix() for c in store.list_checkpoints(out)]
    rels += [name for name in ("metrics.jsonl", "memory.json", SUMMARY, IDS_FILE) if (out / name).is_file()]
    for pattern in PROFILE_FILES:
        rels += sorted(p.relative_to(out).as_posix() for p in (out / "profile").glob(pattern) if p.is_file())
    if tensorboard_dir:
        tb, root = Path(tensorboard_dir).resolve(), out.resolve()
        if tb == root or root in tb.parents:
            rels += sorted(
                (tb.relative_to(root) / p.name).as_posix() for p in tb.glob("events.out.tfevents.*") if p.is_file()
            )
    return rels


PROFILE_FILES = ("trace_rank*.json", "top_ops_rank*.txt", "memory_rank*.pickle")  # observe/profile.py


def _remove_empty_dirs(top: Path) -> None:
    """Remove `top` and the directories below it that are empty (deepest first); never a file."""
    for d in sorted((p for p in top.rglob("*") if p.is_dir() and not p.is_symlink()), key=lambda p: -len(p.parts)):
        try:
            d.rmdir()
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
    try:
        top.rmdir()
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
            raise


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
