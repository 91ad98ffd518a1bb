"""Writing checkpoints, in line or overlapped with training (`async_save: true`), with one set of guarantees.

A save of step N (the layout is in store.py):
1. rank 0 creates `step_N.tmp`; every rank writes its shards of `model/` and `optim/` there through DCP;
2. rank 0 writes config.yaml, tokenizer.json, trainer_state.json and, last, manifest.json (sizes and SHA-256);
3. every rank says whether its part succeeded (one all-reduce). On any failure every rank raises the same
   one-line UserError and `step_N.tmp` is removed, earlier checkpoints untouched; on success rank 0 renames
   `step_N.tmp` to `step_N` (an older copy of that step moved aside first, deleted after).

In line, 1-3 run before training goes on. With async_save, the save call only stages: DCP copies this rank's
tensors into fresh CPU memory (a snapshot: the next optimizer step may change the weights at once) and writes
them from a background thread; step 2 (hashing every file, the slow part on rank 0) runs in a background
thread too. Step 3 runs at the first step boundary where every rank's background work is done (one all-reduce
per step while a save is pending), or before the next save, a rollback, a stop, or the end of the run. Until
the rename the checkpoint does not exist for resume or pruning, so a kill at any moment loses that save only.

DCP gives each async save a thread of its own and the background writes run collectives; collectives of two
threads must never share a process group, so each of the two state dicts gets its own gloo group (`groups`),
apart from the training collectives of the main thread.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from meshformer.checkpoint.manifest import write_manifest
from meshformer.checkpoint.store import dcp_call, model_state_dict, optimizer_state_dict, reason
from meshformer.errors import UserError

SAVE_ERRORS = (OSError, CheckpointException, RuntimeError)  # what a failed write raises (DCP wraps per rank)


@dataclass
class _Save:
    path: Path
    state: dict
    files: dict[str, bytes]
    writes: list[Future] = field(default_factory=list)  # DCP's async saves of this rank
    finishing: Future | None = None  # this rank's background completion (waits `writes`, then step 2)
    error: str | None = None

    @property
    def tmp(self) -> Path:
        return self.path.with_name(self.path.name + ".tmp")


class CheckpointSaver:
    """Saves for one run. Collective: every rank calls `save`, `poll` and `wait` at the same points.

    `agree(ok)` is True only when every rank's ok is (an all-reduce); `groups`: two process groups for the
    background writes (async only; None in one process without a process group).
    """

    def __init__(
        self,
        rank: int = 0,
        agree: Callable[[bool], bool] = lambda ok: ok,
        barrier: Callable[[], None] = lambda: None,
        async_save: bool = False,
        groups: Sequence[object] = (None, None),
        on_saved: Callable[[Path], None] = lambda path: None,
    ):
        self.is_writer = rank == 0
        self.agree, self.barrier, self.async_save, self.groups = agree, barrier, async_save, tuple(groups)
        self.on_saved = on_saved
        self.pending: _Save | None = None
        self._background = ThreadPoolExecutor(1, thread_name_prefix="meshformer-save") if async_save else None

    def save(self, path: Path, parts, optimizers, trainer_state: dict, extra_files: dict[str, bytes]) -> None:
        """Save step `path`: complete on return when in line; staged (and pending) with async_save."""
        self.wait()  # one save in flight at a time: the previous one completes (or fails) first
        job = _Save(path, trainer_state, extra_files)
        if self.is_writer:
            try:
                if job.tmp.exists():
                    shutil.rmtree(job.tmp)
                job.tmp.mkdir(parents=True)
            except OSError as e:
                job.error = reason(e)
        if not self.agree(job.error is None):  # also the barrier: nobody writes before the directory exists
            self._fail(job)
        states = [(model_state_dict(parts), "model")]
        if optimizers:  # an imported model has weights only
            states.append((optimizer_state_dict(parts, optimizers), "optim"))
        for (sd, sub), group in zip(states, self.groups):
            writer = dcp.HuggingFaceStorageWriter(str(job.tmp / sub), save_distributed=True)
            try:
                if self.async_save:
                    job.writes.append(dcp.async_save(sd, storage_writer=writer, process_group=group))
                else:
                    dcp_call(dcp.save, sd, storage_writer=writer)
            except SAVE_ERRORS as e:
                job.error = job.error or reason(e)
        if self.async_save:
            job.finishing = self._background.submit(self._write_files, job)
            self.pending = job
        else:
            self._write_files(job)
            self._complete(job)

    def poll(self) -> None:
        """At a step boundary: complete the pending save if every rank's background work is done."""
        if self.pending is not None and self.agree(self.pending.finishing.done()):
            self.wait()

    def wait(self) -> None:
        """Complete the pending save (blocking until its writes end); a failure raises the one-line UserError."""
        job, self.pending = self.pending, None
        if job is not None:
            job.finishing.result()  # _write_files records errors in job.error rather than raising
            self._complete(job)

    def close(self) -> None:
        if self._background is not None:
            self._background.shutdown(wait=True)

    def _write_files(self, job: _Save) -> None:
        """Wait for this rank's DCP writes; on rank 0 then write the small files and the manifest, last."""
        for f in job.writes:
            try:
                f.result()
            except SAVE_ERRORS as e:
                job.error = job.error or reason(e)
        if job.error is not None or not self.is_writer:
            return
        try:
            for name, data in job.files.items():
                (job.tmp / name).write_bytes(data)
            (job.tmp / "trainer_state.json").write_text(json.dumps(job.state, indent=1))
            write_manifest(job.tmp)
        except OSError as e:
            job.error = reason(e)

    def _complete(self, job: _Save) -> None:
        if not self.agree(job.error is None):
            self._fail(job)
        if self.is_writer:
            replace_dir(job.tmp, job.path)
        self.barrier()
        self.on_saved(job.path)

    def _fail(self, job: _Save):
        if self.is_writer:
            shutil.rmtree(job.tmp, ignore_errors=True)
        raise UserError(
            f"saving checkpoint {job.path.name} failed ({job.error or 'on another rank'}); earlier checkpoints in "
            f"{job.path.parent} are untouched: free space (or fix the output_dir), then resume_training: true"
        )


def save_checkpoint(path: Path, parts, optimizers, trainer_state: dict, extra_files: dict[str, bytes]) -> Path:
    """One process, in line: the whole protocol above with no process group (tools and tests)."""
    CheckpointSaver().save(path, parts, optimizers, trainer_state, extra_files)
    return path


def replace_dir(new: Path, target: Path) -> None:
    """Put `new` at `target`. An existing target is moved aside first and deleted only once `new` is in place,
    so at every moment one complete copy exists under a name `clean_leftovers` or resume understands."""
    if target.exists():
        old = target.with_name(target.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        target.rename(old)
        new.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        new.rename(target)
