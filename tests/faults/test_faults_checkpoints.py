"""Checkpoint faults: damaged checkpoints are set aside on every restart mode, never overwritten or pruned;
safetensors files follow the umask; a run without a tokenizer stays usable; `ckpt` tools on damaged input."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from conftest import EMPTY, checksums, fails, tiny_overrides
from meshformer.checkpoint import store
from meshformer.cli.main import main


def saving(every: int, keep: int = 5) -> str:
    return (
        "[{type: MFLossMonitor, per_print_times: 100}, "
        f"{{type: CheckpointMonitor, save_checkpoint_steps: {every}, keep_checkpoint_max: {keep}}}]"
    )


def train(dataset: Path, out: Path, **extra) -> int:
    extra.setdefault("runner_config.stop_step", 6)
    extra.setdefault("lr_schedule.total_steps", 6)
    extra.setdefault("callbacks", saving(2))
    return main(["train", EMPTY, *tiny_overrides(dataset, out, extra)])


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def step_dir(out: Path, step: int) -> Path:
    return store.checkpoint_root(out) / f"step_{step:08d}"


@pytest.fixture(scope="module")
def run6(tiny_dataset, tmp_path_factory) -> Path:
    """An uninterrupted 6-step run with checkpoints at steps 2, 4 and 6 (made once)."""
    out = tmp_path_factory.mktemp("run6") / "run"
    assert train(tiny_dataset, out) == 0
    assert [c.name for c in store.list_checkpoints(out)] == ["step_00000002", "step_00000004", "step_00000006"]
    return out


def damage_two_newest(out: Path) -> dict[int, dict[str, str]]:
    """step 4 loses only its manifest.json (its shards intact); step 6 gets a truncated shard. Returns the
    checksums of what is left of each."""
    (step_dir(out, 4) / "manifest.json").unlink()
    shard = next((step_dir(out, 6) / "model").glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return {4: checksums(step_dir(out, 4)), 6: checksums(step_dir(out, 6))}


def assert_set_aside(out: Path, damaged: dict[int, dict[str, str]], log: str) -> None:
    """Each damaged checkpoint is at step_N.damaged, byte for byte, named in one warning line with its reason."""
    reasons = {2: "(truncated or replaced)", 4: "manifest.json is missing", 6: "(truncated or replaced)"}
    reasons[14] = reasons[4]
    for step, sums in damaged.items():
        aside = store.checkpoint_root(out) / f"step_{step:08d}.damaged"
        assert checksums(aside) == sums, step
        lines = [ln for ln in log.splitlines() if f"set aside as {aside}" in ln]
        assert len(lines) == 1 and lines[0].startswith("warning:") and reasons[step] in lines[0], log


@pytest.mark.parametrize("mode", ["auto", "true", "finetune"])
def test_resume_sets_damaged_checkpoints_aside_and_continues_from_the_good_one(
    tiny_dataset, run6, tmp_path, capsys, mode
):
    out = tmp_path / "run"
    shutil.copytree(run6, out)
    damaged = damage_two_newest(out)
    capsys.readouterr()
    extra = {"resume_training": mode}
    if mode == "finetune":  # a fine-tune restarted over its own checkpoints: auto resumes them
        extra = {"run_mode": "finetune", "load_checkpoint": str(step_dir(run6, 2)), "resume_training": "auto"}
    # keep_checkpoint_max 1: pruning after each save must neither count nor delete the damaged ones
    assert train(tiny_dataset, out, callbacks=saving(2, keep=1), **extra) == 0
    log = capsys.readouterr().out
    assert f"resumed from {step_dir(out, 2)} at step 2" in log
    assert_set_aside(out, damaged, log)
    assert [c.name for c in store.list_checkpoints(out)] == ["step_00000006"]
    assert losses(out) == losses(run6)  # steps 3..6 redone from step 2: bit for bit the uninterrupted run
    if mode == "auto":  # ckpt info names what was set aside, and where
        assert main(["ckpt", "info", str(out)]) == 0
        shown = capsys.readouterr().out
        for step in damaged:
            assert f"step_{step:08d}.damaged\n  status: damaged, set aside for repair" in shown, shown


@pytest.mark.parametrize("resume", ["false", "auto"])
def test_overwrite_replaces_the_run_but_keeps_its_damaged_checkpoints(tiny_dataset, run6, tmp_path, capsys, resume):
    out = tmp_path / "run"
    shutil.copytree(run6, out)
    damaged = damage_two_newest(out)
    if resume == "auto":  # no checkpoint verifies: auto with overwrite starts over
        (step_dir(out, 2) / "trainer_state.json").write_text("{}")
        damaged[2] = checksums(step_dir(out, 2))
    capsys.readouterr()
    rc = train(tiny_dataset, out, overwrite_output_dir=True, resume_training=resume, **{"runner_config.stop_step": 1})
    assert rc == 0
    log = capsys.readouterr().out
    assert [c.name for c in store.list_checkpoints(out)] == ["step_00000001"] and not list(out.glob(".replaced-*"))
    assert_set_aside(out, damaged, log)


@pytest.fixture
def umask():
    """Set the process umask for one test, restoring it after."""
    old = os.umask(0o022)
    yield os.umask
    os.umask(old)


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_every_written_file_follows_the_umask(run6, tmp_path, capsys, umask, mask):
    umask(mask)
    ckpt = str(step_dir(run6, 2))
    written = {
        "export": (["export", ckpt, "--output", str(tmp_path / "hf")], tmp_path / "hf"),
        "merge": (["ckpt", "merge", ckpt, "--output", str(tmp_path / "m"), "--optimizer"], tmp_path / "m"),
        "mindspore safetensors": (
            ["export", ckpt, "--format", "mindspore", "--output", str(tmp_path / "ms.safetensors")],
            tmp_path / "ms.safetensors",
        ),
        "mindspore ckpt": (["export", ckpt, "--format", "mindspore", "--output", str(tmp_path / "ms.ckpt")], None),
        "gguf": (["export", ckpt, "--format", "gguf", "--output", str(tmp_path / "m.gguf")], None),
    }
    for name, (argv, _) in written.items():
        assert main(argv) == 0, (name, capsys.readouterr().err)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert {p.suffix for p in files} >= {".safetensors", ".json", ".ckpt", ".gguf"}
    modes = {p.relative_to(tmp_path).as_posix(): oct(stat.S_IMODE(p.stat().st_mode)) for p in files}
    assert set(modes.values()) == {oct(0o666 & ~mask)}, modes


@pytest.fixture(scope="module")
def no_tokenizer_run(tmp_path_factory) -> tuple[Path, str]:
    """A 2-step run on MindRecord data (which carries no tokenizer) without processor.tokenizer: (run, its log)."""
    import numpy as np

    FileWriter = pytest.importorskip("mindspore.mindrecord").FileWriter
    root = tmp_path_factory.mktemp("notok")
    (root / "data").mkdir()
    writer = FileWriter(str(root / "data" / "x.mindrecord"), shard_num=1, overwrite=True)
    writer.set_header_size(1 << 14)
    writer.set_page_size(1 << 15)
    writer.add_schema({"input_ids": {"type": "int32", "shape": [-1]}}, "no tokenizer")
    g = np.random.default_rng(1)
    writer.write_raw_data([{"input_ids": g.integers(0, 512, 17).astype(np.int32)} for _ in range(48)])
    writer.commit()
    extra = {"model.model_config.seq_length": 16, "runner_config.stop_step": 2}
    logged = io.StringIO()  # a module fixture has no capsys
    with contextlib.redirect_stdout(logged):
        assert main(["train", EMPTY, *tiny_overrides(root / "data", root / "run", extra)]) == 0
    return root / "run", logged.getvalue()


def test_a_run_without_a_tokenizer_warns_at_start_and_exports_its_weights(no_tokenizer_run, tmp_path, capsys):
    run, log = no_tokenizer_run
    warned = [ln for ln in log.splitlines() if "no tokenizer" in ln]
    assert len(warned) == 1 and warned[0].startswith("warning: this run will have no tokenizer"), log
    assert "processor.tokenizer.tokenizer_file" in warned[0]
    capsys.readouterr()
    for argv, out in (
        (["ckpt", "merge", str(run), "--output", str(tmp_path / "merged")], tmp_path / "merged"),
        (["export", str(run), "--output", str(tmp_path / "hf")], tmp_path / "hf"),
    ):
        assert main(argv) == 0, capsys.readouterr().err
        err = capsys.readouterr().err
        assert err.count("has no tokenizer.json") == 1 and f"{out} holds the weights" in err, err
        assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
        assert not (out / "tokenizer.json").exists()
    assert main(["export", str(run), "--format", "mindspore", "--output", str(tmp_path / "ms.ckpt")]) == 0
    assert (tmp_path / "ms.ckpt").stat().st_size > 100_000
    # --verify needs no text: without a tokenizer it compares transformers' logits on seeded random ids
    assert main(["export", str(run), "--output", str(tmp_path / "hf_verified"), "--verify"]) == 0
    assert "max |logit difference|" in capsys.readouterr().out


def test_generate_and_eval_without_a_tokenizer_say_how_to_add_one(no_tokenizer_run, tokenizer_dir, tmp_path, capsys):
    run, _ = no_tokenizer_run
    text = tmp_path / "t.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 4)
    before = checksums(run)
    for argv in (
        ["generate", "--checkpoint", str(run), "--prompt", "to be", "--max-new-tokens", "2"],
        ["eval", "--checkpoint", str(run), "--input", str(text)],
        ["export", str(run), "--format", "gguf", "--output", str(tmp_path / "m.gguf")],
    ):
        line = fails(capsys, argv, "step_00000002", "has no tokenizer.json", "meshformer import DIR --output NEW")
        assert "--tokenizer" not in line  # no flag that does not exist
    assert checksums(run) == before and not (tmp_path / "m.gguf").exists()
    # the way the line gives works: export, add the tokenizer, import, generate
    assert main(["export", str(run), "--output", str(tmp_path / "hf")]) == 0
    shutil.copy(tokenizer_dir / "tokenizer.json", tmp_path / "hf")
    assert main(["import", str(tmp_path / "hf"), "--output", str(tmp_path / "new")]) == 0
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(tmp_path / "new"), "--prompt", "to be", "--max-new-tokens", "2"]) == 0
    assert capsys.readouterr().out.startswith("to be")


def forged(run: Path, tmp_path: Path, change) -> Path:
    """A copy of run's step 2 with `change(dir)` applied and its manifest rewritten to match (every checksum holds)."""
    from meshformer.checkpoint.manifest import write_manifest

    ckpt = tmp_path / "step_00000002"
    shutil.copytree(step_dir(run, 2), ckpt)
    change(ckpt)
    write_manifest(ckpt)
    return ckpt


FORGERIES = {
    "trainer_state.json a list": (
        lambda d: (d / "trainer_state.json").write_text("[1]"),
        "trainer_state.json is not a JSON object",
    ),
    "trainer_state.json without a step": (
        lambda d: (d / "trainer_state.json").write_text('{"step": -1}'),
        "trainer_state.json has no valid step (got -1)",
    ),
    "no model/ at all": (lambda d: shutil.rmtree(d / "model"), "model/ holds no weights"),
}


@pytest.mark.parametrize("kind", sorted(FORGERIES))
def test_ckpt_tools_name_a_forged_checkpoint_that_has_no_step_or_no_weights(run6, tmp_path, capsys, kind):
    change, why = FORGERIES[kind]
    ckpt = forged(run6, tmp_path, change)
    before = checksums(tmp_path)
    capsys.readouterr()
    assert main(["ckpt", "verify", str(ckpt)]) == 1
    assert f"{ckpt}: BAD: {why}" in capsys.readouterr().out
    assert main(["ckpt", "info", str(ckpt)]) == 0
    assert f"status: {why}" in capsys.readouterr().out
    fails(capsys, ["ckpt", "merge", str(ckpt), "--output", str(tmp_path / "merged")], str(ckpt), why, "not usable")
    assert checksums(tmp_path) == before


def test_ckpt_on_a_path_that_does_not_exist_or_is_a_file(tmp_path, capsys):
    missing, file = tmp_path / "step_00000007", tmp_path / "step_00000008"
    file.write_text("not a checkpoint")
    fails(capsys, ["ckpt", "merge", str(missing), "--output", str(tmp_path / "m")], f"{missing} does not exist")
    fails(capsys, ["ckpt", "merge", str(file), "--output", str(tmp_path / "m")], f"{file} is not a directory")
    assert main(["ckpt", "verify", str(file)]) == 1
    assert f"BAD: {file} is not a directory" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == [file.name]


def test_merge_and_export_refuse_an_output_under_a_file_or_inside_the_checkpoint(run6, tmp_path, capsys):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine\n")
    ckpt = step_dir(run6, 2)
    before = checksums(run6), checksums(tmp_path)
    for argv in (
        ["ckpt", "merge", str(ckpt), "--output", str(a_file / "merged")],
        ["export", str(ckpt), "--output", str(a_file / "hf")],
        ["export", str(ckpt), "--format", "gguf", "--output", str(a_file / "m.gguf")],
        ["export", str(ckpt), "--format", "mindspore", "--output", str(a_file / "m.ckpt")],
    ):
        fails(capsys, argv, f"{a_file} is a file, not a directory")
    for argv in (
        ["ckpt", "merge", str(run6), "--output", str(ckpt / "merged")],
        ["export", str(ckpt), "--output", str(ckpt / "hf")],
    ):
        fails(capsys, argv, "lies inside the checkpoint", str(ckpt))
    assert (checksums(run6), checksums(tmp_path)) == before


def test_a_rollback_sets_aside_the_damaged_checkpoint_it_skips(tiny_dataset, tmp_path, capsys, monkeypatch):
    """A spike at step 15 when the newest checkpoint (14) has just lost its manifest: the rollback goes to step 12,
    and the replay's save of step 14 does not replace the damaged one, which is set aside as it was."""
    import meshformer.train.trainer as trainer_module

    out, real, calls, damaged = tmp_path / "run", trainer_module.train_step, [], {}

    def spiky(*a, **kw):
        result = real(*a, **kw)
        calls.append(1)
        if len(calls) == 15:
            (step_dir(out, 14) / "manifest.json").unlink()
            damaged[14] = checksums(step_dir(out, 14))
            result.loss *= 100
        return result

    monkeypatch.setattr(trainer_module, "train_step", spiky)
    spike = {"runner_wrapper.loss_spike_factor": 3.0, "lr_schedule.total_steps": 30, "runner_config.stop_step": 16}
    assert train(tiny_dataset, out, **spike) == 0
    log = capsys.readouterr().out
    assert "rolled back to step_00000012" in log
    assert_set_aside(out, damaged, log)
    assert [c.name for c in store.list_checkpoints(out)][-2:] == ["step_00000014", "step_00000016"]
