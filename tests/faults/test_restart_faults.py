"""Restart modes never delete what meshformer did not write, or what can still be recovered.

Every replacing command (overwrite_output_dir, `resume_training: auto` over a damaged run or after an attempt
that died before its first save) runs in-process through the CLI entry point, with checksums of the user's files
and of the earlier run's files taken before and compared after. A refusal is one line on stderr and exit code 2.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import EMPTY, checksums, refused, tiny_overrides
from meshformer.checkpoint import store
from meshformer.cli.main import main
from meshformer.train.run_dir import REPLACED, RunDir
from meshformer.train.trainer import Trainer

EVERY_STEP = "[{type: MFLossMonitor, per_print_times: 100}, {type: CheckpointMonitor, save_checkpoint_steps: 1}]"
# A user's own files in and under output_dir: none of them is meshformer's.
USER_FILES = {
    "notes.txt": b"my notes on this run\n",
    "checkpoint/README.txt": b"which step to keep\n",
    "profile/analysis.md": b"what the trace says\n",
    "tb/annotations.txt": b"tensorboard notes\n",
    "eval/scores.jsonl": b'{"mmlu": 0.25}\n',
}


def tb(out: Path) -> dict:
    """TensorBoard inside output_dir: its event files are the run's own (moved aside with it when replaced)."""
    return {"tensorboard.tensorboard_dir": str(out / "tb")}


def train(dataset: Path, out: Path, **extra) -> int:
    extra.setdefault("runner_config.stop_step", 2)
    extra.setdefault("lr_schedule.total_steps", 6)
    return main(["train", EMPTY, *tiny_overrides(dataset, out, extra)])


def add_user_files(out: Path) -> dict[str, str]:
    for rel, data in USER_FILES.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(data)
    return {rel: h for rel, h in checksums(out).items() if rel in USER_FILES}


def user_sums(out: Path) -> dict[str, str]:
    return {rel: h for rel, h in checksums(out).items() if rel in USER_FILES}


def steps(out: Path) -> list[int]:
    return [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def finished_run(tiny_dataset, tmp_path_factory) -> Path:
    """A finished 2-step run: checkpoints at 1 and 2, TensorBoard inside output_dir, a profile (made once)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert train(tiny_dataset, out, callbacks=EVERY_STEP, profile="1:1", **tb(out)) == 0
    assert [c.name for c in store.list_checkpoints(out)] == ["step_00000001", "step_00000002"]
    assert list((out / "tb").glob("events.out.tfevents.*")) and list((out / "profile").glob("trace_rank*.json"))
    return out


@pytest.fixture
def old_run(finished_run, tmp_path, capsys) -> Path:
    """A copy of the finished run, with the user's files added."""
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    add_user_files(out)
    capsys.readouterr()
    return out


def _damage(out: Path) -> None:
    first, second = store.list_checkpoints(out)
    shard = next((second / "model").glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    (first / "trainer_state.json").write_text("not json")


@pytest.mark.parametrize("mode", ["auto", "true"])
def test_resume_over_a_run_whose_checkpoints_are_all_unusable_refuses(tiny_dataset, old_run, capsys, mode):
    _damage(old_run)
    before = checksums(old_run)
    rc = train(tiny_dataset, old_run, resume_training=mode, **{"runner_config.stop_step": 3})
    refused(
        capsys,
        rc,
        f"resume_training: {mode}: no usable checkpoint in {old_run}",
        "step_00000002: model/",
        "(truncated or replaced)",
        "step_00000001: trainer_state.json",
        "nothing was changed",
        "overwrite_output_dir: true",
    )
    assert checksums(old_run) == before and not list(old_run.glob(".replaced-*"))


@pytest.mark.parametrize("mode", ["plain", "auto over a damaged run"])
def test_overwrite_moves_aside_only_meshformers_files(tiny_dataset, old_run, capsys, mode):
    resume = {}
    if mode != "plain":  # overwrite replaces the run, but damaged checkpoints (maybe repairable) are set aside
        _damage(old_run)
        resume = {"resume_training": "auto"}
    users = user_sums(old_run)
    old_own = {k: v for k, v in checksums(old_run).items() if k not in users}
    damaged = {k: v for k, v in old_own.items() if mode != "plain" and k.startswith("checkpoint/")}
    old_own = {k: v for k, v in old_own.items() if k not in damaged}
    moved_at_replace: dict[str, str] = {}
    real_saved = RunDir.saved

    def saved(self):  # the moved-aside copy as it is just before it is deleted: the old run's files exactly
        if self.aside is not None:
            moved_at_replace.update(checksums(self.aside))
        real_saved(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RunDir, "saved", saved)
        rc = train(tiny_dataset, old_run, overwrite_output_dir=True, **tb(old_run), **resume)
    assert rc == 0, capsys.readouterr().err
    assert moved_at_replace == old_own  # every file of the old run, and nothing but those, went aside
    assert user_sums(old_run) == users  # the user's files are where they were, byte for byte
    assert not list(old_run.glob(".replaced-*"))
    assert [c.name for c in store.list_checkpoints(old_run)] == ["step_00000002"] and steps(old_run) == [1, 2]
    assert "other files stay" in capsys.readouterr().out
    aside = {k.replace(".damaged/", "/"): v for k, v in checksums(old_run).items() if ".damaged/" in k}
    assert aside == damaged  # still there, byte for byte, beside the new run's checkpoint


def test_deleting_the_replaced_run_deletes_only_what_was_moved(tiny_dataset, old_run, capsys):
    users = user_sums(old_run)
    real_saved = RunDir.saved

    def saved(self):  # a file that appears in the moved-aside copy during the run was not moved there: it stays
        if self.aside is not None:
            (self.aside / "checkpoint" / "kept.txt").write_bytes(b"put here by hand\n")
        real_saved(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RunDir, "saved", saved)
        assert train(tiny_dataset, old_run, overwrite_output_dir=True) == 0
    (aside,) = old_run.glob(".replaced-*")
    assert checksums(aside) == {"checkpoint/kept.txt": hashlib.sha256(b"put here by hand\n").hexdigest()}
    assert user_sums(old_run) == users
    assert "it stays: it holds files this run did not move there" in capsys.readouterr().out


def _dies_before_saving(monkeypatch):
    monkeypatch.setattr(Trainer, "save", lambda self, step, best=False: (_ for _ in ()).throw(KeyboardInterrupt()))


def test_an_overwrite_that_dies_before_saving_keeps_the_old_run_and_the_users_files(
    tiny_dataset, old_run, capsys, monkeypatch
):
    users = user_sums(old_run)
    old_own = {k: v for k, v in checksums(old_run).items() if k not in users}
    _dies_before_saving(monkeypatch)
    assert (
        train(tiny_dataset, old_run, overwrite_output_dir=True, **tb(old_run)) == 130
    )  # killed (Ctrl-C) before its first save
    monkeypatch.undo()
    (aside,) = old_run.glob(".replaced-*")
    assert checksums(aside) == old_own and user_sums(old_run) == users
    # The next replacing run moves the dead attempt's files aside in turn, and leaves the first copy alone.
    assert train(tiny_dataset, old_run, overwrite_output_dir=True, **tb(old_run), **{"runner_config.stop_step": 1}) == 0
    assert f"{aside} holds a run that an earlier overwrite moved aside" in capsys.readouterr().out
    assert list(old_run.glob(".replaced-*")) == [aside] and checksums(aside) == old_own
    assert user_sums(old_run) == users and steps(old_run) == [1]


def test_auto_after_an_attempt_that_died_before_its_first_save(tiny_dataset, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    _dies_before_saving(monkeypatch)
    assert train(tiny_dataset, out, resume_training="auto") == 130  # a first attempt: metrics.jsonl, no checkpoint
    monkeypatch.undo()
    assert (out / "metrics.jsonl").exists() and not store.list_checkpoints(out)
    users = add_user_files(out)
    assert train(tiny_dataset, out, resume_training="auto") == 0  # the restart starts over, replacing safely
    log = capsys.readouterr().out
    assert f"no checkpoint in {out} yet; starting from step 0" in log and "deleted the replaced run" in log
    assert user_sums(out) == users and not list(out.glob(".replaced-*")) and steps(out) == [1, 2]
    # With a good checkpoint now there, auto resumes from it and replaces nothing.
    before = checksums(store.list_checkpoints(out)[-1])
    assert train(tiny_dataset, out, resume_training="auto", **{"runner_config.stop_step": 3}) == 0
    assert checksums(out / "checkpoint" / "step_00000002") == before and user_sums(out) == users


def test_a_save_killed_between_its_renames_keeps_the_step(tiny_dataset, finished_run, tmp_path, capsys):
    """`step_N.old` without `step_N` is that step's only complete copy: restored at start, not removed."""
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    root = store.checkpoint_root(out)
    (root / "step_00000002").rename(root / "step_00000002.old")
    shutil.copytree(root / "step_00000002.old", root / "step_00000002.tmp")
    (root / "step_00000002.tmp" / "manifest.json").unlink()  # the new copy, killed before it was complete
    before = checksums(root / "step_00000002.old")
    assert train(tiny_dataset, out, resume_training=True, **{"runner_config.stop_step": 3}) == 0
    assert f"resumed from {root / 'step_00000002'} at step 2" in capsys.readouterr().out
    assert checksums(root / "step_00000002") == before and not (root / "step_00000002.tmp").exists()


# ---------------------------------------------------------------- an output_dir that cannot be written


def _can_mount() -> str:
    if os.geteuid() != 0 or not shutil.which("mount"):
        return "mounting a read-only filesystem needs root"
    return ""


@pytest.fixture
def readonly_fs(tmp_path):
    """A tmpfs made read-only after a run was written to it (root only: what a read-only NFS export looks like)."""
    why = _can_mount()
    if why:
        pytest.skip(why)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("mount -t tmpfs refused (no CAP_SYS_ADMIN in this container)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_read_only_filesystem_is_one_line(tiny_dataset, readonly_fs, capsys, overwrite):
    out = readonly_fs / "run"
    assert train(tiny_dataset, out) == 0
    add_user_files(out)
    subprocess.run(["mount", "-o", "remount,ro", str(readonly_fs)], check=True)
    before = checksums(readonly_fs)
    capsys.readouterr()
    rc = train(
        tiny_dataset, out, resume_training=True, overwrite_output_dir=overwrite, **{"runner_config.stop_step": 3}
    )
    refused(capsys, rc, f"output_dir={str(out)!r} is not writable (Read-only file system)", "writable filesystem")
    rc = train(tiny_dataset, readonly_fs / "new")  # a new output_dir there cannot be made either
    refused(capsys, rc, "is not writable (Read-only file system)")
    assert checksums(readonly_fs) == before


def test_an_output_dir_without_write_permission_is_one_line(tiny_dataset, tmp_path, capsys):
    probe = tmp_path / "probe"
    probe.mkdir(mode=0o555)
    try:
        (probe / "x").touch()
        pytest.skip(
            "this user writes through chmod 0555 (root, CAP_DAC_OVERRIDE): the read-only filesystem test covers it"
        )
    except PermissionError:
        pass
    out = tmp_path / "run"
    assert train(tiny_dataset, out) == 0  # its .lock exists and stays writable: the probe must still refuse
    add_user_files(out)
    before = checksums(out)
    out.chmod(0o555)
    try:
        rc = train(tiny_dataset, out, overwrite_output_dir=True)
        refused(capsys, rc, f"output_dir={str(out)!r} is not writable (Permission denied)")
        out_new = out / "sub" / "new"
        refused(capsys, train(tiny_dataset, out_new), "is not writable (Permission denied)")
    finally:
        out.chmod(0o755)
    assert checksums(out) == before


def test_a_stop_signal_during_the_move_puts_everything_back(tiny_dataset, old_run, capsys, monkeypatch):
    """Ctrl-C (or a preemption signal) while the old run is being moved aside: every file is back in place, not
    half moved (a later auto restart would otherwise resume the run the user asked to replace)."""
    before = checksums(old_run)
    real, calls = Path.rename, []

    def rename(self, target):
        calls.append(self)
        if len(calls) == 3 and REPLACED in str(target):
            raise KeyboardInterrupt
        return real(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    assert train(tiny_dataset, old_run, overwrite_output_dir=True, **tb(old_run)) == 130
    monkeypatch.undo()
    assert checksums(old_run) == before and not list(old_run.glob(REPLACED + "*"))
