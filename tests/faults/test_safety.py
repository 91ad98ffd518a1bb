"""Nothing lost: verified checkpoints with fallback, safe overwrite, a full disk, NaN steps skipped, one run per dir.

Every test that damages or refuses something compares checksums of every file that was there before.
"""

from __future__ import annotations

import errno
import json
import math
import shutil
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import checksums, tiny_overrides
from meshformer.checkpoint import manifest, saver, store
from meshformer.config import load_config
from meshformer.errors import RunFailed, UserError
from meshformer.train.trainer import Trainer, run_training

EVERY_STEP = "[{type: MFLossMonitor, per_print_times: 100}, {type: CheckpointMonitor, save_checkpoint_steps: 1, keep_checkpoint_max: 5}]"  # noqa: E501


def run(dataset, out, **extra):
    extra.setdefault("lr_schedule.total_steps", 6)
    run_training(load_config(None, tiny_overrides(dataset, out, extra)))
    return metrics(out)


def metrics(out: Path) -> list[dict]:
    def no_nan(name):
        raise ValueError(f"bare {name} in metrics.jsonl")

    return [json.loads(ln, parse_constant=no_nan) for ln in (out / "metrics.jsonl").read_text().splitlines()]


def losses(recs):
    return [(r["step"], r["loss"], r["grad_norm"]) for r in recs]


@pytest.fixture(scope="module")
def reference(tiny_dataset, tmp_path_factory):
    """An uninterrupted 6-step run, saving every step."""
    out = tmp_path_factory.mktemp("ref") / "run"
    return losses(run(tiny_dataset, out, **{"runner_config.stop_step": 6, "callbacks": EVERY_STEP}))


# ---------------------------------------------------------------- verified checkpoints


def _truncate(f: Path):
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _random_bytes(f: Path):
    data = bytearray(f.read_bytes())
    data[-64:-32] = bytes(range(32))  # inside the tensor data, same size
    f.write_bytes(bytes(data))


def _flip(f: Path):
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))


CORRUPTIONS = {
    "truncated shard": ("model", _truncate),
    "random bytes in a shard": ("model", _random_bytes),
    "flipped byte": ("optim", _flip),
    "missing manifest": ("manifest.json", lambda f: f.unlink()),
    "malformed trainer_state": ("trainer_state.json", lambda f: f.write_text("{not json")),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_resume_falls_back_past_a_damaged_checkpoint_and_matches_the_uninterrupted_run(
    tiny_dataset, tmp_path, reference, kind, capsys
):
    out = tmp_path / "run"
    run(tiny_dataset, out, **{"runner_config.stop_step": 4, "callbacks": EVERY_STEP})
    newest = store.checkpoint_root(out) / "step_00000004"
    where, damage = CORRUPTIONS[kind]
    target = newest / where
    damage(next(target.glob("*.safetensors")) if target.is_dir() else target)
    reason = manifest.verify(newest)
    assert reason is not None and (where.split("/")[0] in reason or "manifest" in reason), reason
    recs = run(tiny_dataset, out, **{"runner_config.stop_step": 6, "callbacks": EVERY_STEP, "resume_training": True})
    log = capsys.readouterr().out
    assert f"skipped checkpoint {newest}" in log and "resumed from" in log and "step_00000003 at step 3" in log
    assert losses(recs) == reference  # steps 4..6 redone from step 3: bit for bit the uninterrupted run


def test_an_explicit_damaged_checkpoint_is_one_line_and_nothing_changes(tiny_dataset, tmp_path):
    out = tmp_path / "run"
    run(tiny_dataset, out, **{"runner_config.stop_step": 2})
    ckpt = store.checkpoint_root(out) / "step_00000002"
    _flip(next((ckpt / "model").glob("*.safetensors")))
    before = checksums(tmp_path)
    with pytest.raises(UserError, match=r"is not usable: model/.* does not match its checksum") as e:
        run(tiny_dataset, tmp_path / "new", **{"runner_config.stop_step": 2, "load_checkpoint": str(ckpt)})
    assert "\n" not in str(e.value)
    assert checksums(tmp_path) == before


def test_loading_is_strict_about_missing_and_extra_tensors(tiny_dataset, tmp_path):
    out = tmp_path / "run"
    run(tiny_dataset, out, **{"runner_config.stop_step": 2})
    with pytest.raises(UserError, match=r"tensor\(s\) this model does not have, e\.g\. layers\.1\."):
        run(tiny_dataset, tmp_path / "a", **{"load_checkpoint": str(out), "model.model_config.num_layers": 1})
    with pytest.raises(UserError, match=r"tensor\(s\) missing, e\.g\. layers\.2\."):
        run(tiny_dataset, tmp_path / "b", **{"load_checkpoint": str(out), "model.model_config.num_layers": 3})
    shapes = r"6 shape\(s\) differ, e\.g\. .*down_proj.weight is \[32, 64\] there, \[32, 96\] here"
    with pytest.raises(UserError, match=shapes):
        run(tiny_dataset, tmp_path / "c", **{"load_checkpoint": str(out), "model.model_config.intermediate_size": 96})


def test_a_full_disk_is_one_line_and_keeps_the_previous_checkpoint(tiny_dataset, tmp_path, monkeypatch):
    out = tmp_path / "run"
    run(tiny_dataset, out, **{"runner_config.stop_step": 2})
    before = checksums(store.checkpoint_root(out))
    real_save = store.dcp.save

    def full_disk(sd, storage_writer):
        if "optim" in str(storage_writer.path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(sd, storage_writer=storage_writer)

    monkeypatch.setattr(store.dcp, "save", full_disk)
    with pytest.raises(UserError, match="saving checkpoint step_00000004 failed .*No space left on device") as e:
        run(tiny_dataset, out, **{"runner_config.stop_step": 4, "resume_training": True})
    assert "\n" not in str(e.value)
    assert checksums(store.checkpoint_root(out)) == before  # no step_4.tmp left, step_2 untouched


ASYNC_EVERY_STEP = EVERY_STEP.replace("keep_checkpoint_max: 5", "keep_checkpoint_max: 5, async_save: true")


def test_async_save_writes_the_same_checkpoints_as_in_line_saves(tiny_dataset, tmp_path, reference):
    out = tmp_path / "run"
    assert losses(run(tiny_dataset, out, **{"runner_config.stop_step": 6, "callbacks": ASYNC_EVERY_STEP})) == reference
    in_line = tmp_path / "in_line"
    run(tiny_dataset, in_line, **{"runner_config.stop_step": 6, "callbacks": EVERY_STEP})
    for a, b in zip(store.list_checkpoints(out), store.list_checkpoints(in_line), strict=True):
        assert manifest.verify(a, full=True) is None
        shards = sorted(p.relative_to(a) for p in a.rglob("*.safetensors"))
        assert shards == sorted(p.relative_to(b) for p in b.rglob("*.safetensors")) and len(shards) == 2
        for shard in shards:  # the same tensors, bit for bit (the header's metadata order may differ)
            ta, tb = load_file(a / shard), load_file(b / shard)
            assert sorted(ta) == sorted(tb) and all(torch.equal(ta[k], tb[k]) for k in ta), shard
    # and a run resumed from the async run's checkpoints continues like the uninterrupted one
    shutil.rmtree(store.checkpoint_root(out) / "step_00000006")
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics(out)[:5]))
    resumed = run(tiny_dataset, out, **{"runner_config.stop_step": 6, "resume_training": True})
    assert losses(resumed) == reference


def test_a_failed_background_write_is_one_line_and_keeps_the_previous_checkpoint(tiny_dataset, tmp_path, monkeypatch):
    out = tmp_path / "run"
    run(tiny_dataset, out, **{"runner_config.stop_step": 2})
    before = checksums(store.checkpoint_root(out))
    real_async_save = saver.dcp.async_save

    def full_disk(sd, storage_writer, process_group):
        if "optim" not in str(storage_writer.path):
            return real_async_save(sd, storage_writer=storage_writer, process_group=process_group)
        failed = Future()
        failed.set_exception(OSError(errno.ENOSPC, "No space left on device"))
        return failed

    monkeypatch.setattr(saver.dcp, "async_save", full_disk)
    extra = {"runner_config.stop_step": 5, "resume_training": True, "callbacks": ASYNC_EVERY_STEP}
    with pytest.raises(UserError, match="saving checkpoint step_00000003 failed .*No space left on device") as e:
        run(tiny_dataset, out, **extra)
    assert "\n" not in str(e.value)
    assert checksums(store.checkpoint_root(out)) == before  # no step_3.tmp left, step_2 untouched


def test_resaving_a_step_keeps_the_good_copy_until_the_new_one_is_complete(tiny_dataset, tmp_path, monkeypatch):
    out = tmp_path / "run"
    run(tiny_dataset, out, **{"runner_config.stop_step": 2})
    ckpt = store.checkpoint_root(out) / "step_00000002"
    before = checksums(ckpt)
    monkeypatch.setattr(saver, "write_manifest", lambda d: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    trainer = Trainer(load_config(None, tiny_overrides(tiny_dataset, out, {"resume_training": True})))
    try:
        with pytest.raises(UserError, match="I/O error"):
            trainer.save(2)
    finally:
        trainer.run_dir.unlock()
    assert checksums(ckpt) == before and not ckpt.with_name(ckpt.name + ".tmp").exists()


def test_leftovers_of_killed_saves_are_removed_at_start(tiny_dataset, tmp_path, capsys):
    out = tmp_path / "run"
    run(tiny_dataset, out, **{"runner_config.stop_step": 2})
    for name in ("step_00000003.tmp", "step_00000002.old"):
        (store.checkpoint_root(out) / name / "model").mkdir(parents=True)
    run(tiny_dataset, out, **{"runner_config.stop_step": 3, "resume_training": True})
    assert "removed" in capsys.readouterr().out
    assert sorted(p.name for p in store.checkpoint_root(out).iterdir()) == ["step_00000002", "step_00000003"]


# ---------------------------------------------------------------- overwrite and resume never lose a run


def test_overwrite_keeps_the_old_run_until_the_new_one_has_saved(tiny_dataset, tmp_path):
    out = tmp_path / "run"
    old = run(tiny_dataset, out, **{"runner_config.stop_step": 2})
    before = checksums(out)
    for bad in ({"load_checkpoint": str(tmp_path / "nowhere")}, {"train_dataset.data_loader.dataset_dir": "nope"}):
        with pytest.raises(UserError):
            run(tiny_dataset, out, **{"runner_config.stop_step": 2, "overwrite_output_dir": True, **bad})
        assert checksums(out) == before  # a bad input leaves the earlier run exactly as it was
    # Fine-tuning from the run's own checkpoint while replacing it: loaded first, moved aside, deleted after saving.
    new = run(
        tiny_dataset, out, **{"runner_config.stop_step": 2, "overwrite_output_dir": True, "load_checkpoint": str(out)}
    )
    assert losses(new) != losses(old) and not list(out.glob(".replaced-*"))
    assert [p.name for p in store.list_checkpoints(out)] == ["step_00000002"]


def test_a_run_that_dies_before_saving_leaves_the_replaced_run_intact(tiny_dataset, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    run(tiny_dataset, out, **{"runner_config.stop_step": 2})
    before = checksums(out)
    monkeypatch.setattr(Trainer, "save", lambda self, step, best=False: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        run(tiny_dataset, out, **{"runner_config.stop_step": 2, "overwrite_output_dir": True})
    monkeypatch.undo()
    (aside,) = out.glob(".replaced-*")
    assert checksums(aside) == before
    run(tiny_dataset, tmp_path / "other", **{"runner_config.stop_step": 1})
    with pytest.raises(UserError, match="already holds a run"):  # the new run's metrics.jsonl is there
        run(tiny_dataset, out, **{"runner_config.stop_step": 2})
    assert f"{aside} holds a run that an earlier overwrite moved aside" in capsys.readouterr().out


def test_resume_never_restarts_at_step_0_over_existing_metrics(tiny_dataset, tmp_path):
    out = tmp_path / "run"
    run(tiny_dataset, out, **{"runner_config.stop_step": 2})
    shutil.rmtree(store.checkpoint_root(out))
    before = checksums(out)
    with pytest.raises(UserError, match="has metrics.jsonl but no checkpoint to resume from"):
        run(tiny_dataset, out, **{"runner_config.stop_step": 2, "resume_training": True})
    assert checksums(out) == before


def test_one_run_per_output_dir(tiny_dataset, tmp_path):
    out = tmp_path / "run"
    first = Trainer(load_config(None, tiny_overrides(tiny_dataset, out, {"runner_config.stop_step": 1})))
    try:
        with pytest.raises(UserError, match=r"is in use by a running meshformer job \(.*\"pid\""):
            run(tiny_dataset, out, **{"runner_config.stop_step": 1})
    finally:
        first.run_dir.unlock()
    run(tiny_dataset, out, **{"runner_config.stop_step": 1, "overwrite_output_dir": True})  # free again


# ---------------------------------------------------------------- non-finite steps


def test_a_poisoned_batch_is_skipped_and_the_run_goes_on(tiny_dataset, tmp_path, monkeypatch):
    from meshformer.parallel.parts import ModelParts

    real, calls = ModelParts.forward_backward, []

    def poisoned(self, *a, **kw):
        out = real(self, *a, **kw)
        calls.append(1)
        if len(calls) == 3:  # step 3's gradients become NaN, as an overflow or a bad sample would make them
            for p in self.parameters():
                p.grad.fill_(math.nan)
        return out

    monkeypatch.setattr(ModelParts, "forward_backward", poisoned)
    recs = run(tiny_dataset, tmp_path / "run", **{"runner_config.stop_step": 6})
    assert [r["skipped_steps"] for r in recs] == [0, 0, 1, 1, 1, 1]
    assert recs[2]["grad_norm"] is None and recs[2]["grad_norm_nonfinite"] == "nan"
    assert all(math.isfinite(r["loss"]) for r in recs) and recs[-1]["loss"] < recs[0]["loss"]


def test_a_diverging_run_stops_with_exit_1_and_keeps_its_good_checkpoints(tiny_dataset, tmp_path):
    out = tmp_path / "run"
    run(tiny_dataset, out, **{"runner_config.stop_step": 2})
    with pytest.raises(RunFailed, match=r"3 steps in a row .* non-finite .* finite loss: step_00000003\. Lower"):
        run(
            tiny_dataset,
            out,
            **{
                "runner_config.stop_step": 40,
                "resume_training": True,
                "optimizer.learning_rate": 1e6,
                "runner_wrapper.use_clip_grad": False,
                "callbacks": EVERY_STEP,
            },
        )
    recs = metrics(out)  # strict JSON throughout
    assert recs[-1]["skipped_steps"] >= 3
    kept = store.list_checkpoints(out)
    assert any(store.saved_finite(c) and manifest.verify(c) is None for c in kept)  # pruning kept a good one


# ---------------------------------------------------------------- meshformer ckpt info / verify / merge


def test_ckpt_info_verify_and_merge(tiny_dataset, tmp_path, capsys):
    from safetensors.torch import load_file

    from meshformer.cli.main import main
    from meshformer.interop import load_for_inference

    out = tmp_path / "run"
    run(tiny_dataset, out, **{"runner_config.stop_step": 2, "callbacks": EVERY_STEP})
    capsys.readouterr()
    assert main(["ckpt", "info", str(out)]) == 0
    text = capsys.readouterr().out
    model, _, _ = load_for_inference(out)
    n_params = sum(p.numel() for p in model.parameters())
    assert text.count("step_0000000") == 2 and f"{n_params:,} parameters" in text and "status: complete" in text

    assert main(["ckpt", "verify", str(out)]) == 0
    assert capsys.readouterr().out.count(": ok") == 2
    shard = next((store.checkpoint_root(out) / "step_00000002" / "model").glob("*.safetensors"))
    _flip(shard)
    assert main(["ckpt", "verify", str(out)]) == 1
    text = capsys.readouterr().out
    assert "step_00000001: ok" in text and f"step_00000002: BAD: model/{shard.name} does not match its checksum" in text

    merged = tmp_path / "merged"  # a Hugging Face directory (tests/faults/test_ckpt_faults.py: transformers loads it)
    assert main(["ckpt", "merge", str(out), "--output", str(merged)]) == 0  # falls back to step 1
    captured = capsys.readouterr()
    assert "skipped checkpoint" in captured.err and "step_00000001" in captured.out
    model, _, _ = load_for_inference(store.checkpoint_root(out) / "step_00000001")
    tensors = load_file(str(merged / "model.safetensors"))
    hf = {(k if k == "lm_head.weight" else f"model.{k}"): v for k, v in model.state_dict().items()}
    assert tensors.keys() == hf.keys()
    assert all(torch.equal(tensors[k], v) for k, v in hf.items())
    before = checksums(tmp_path)
    assert main(["ckpt", "merge", str(out), "--output", str(merged)]) == 2  # no silent overwrite
    assert "already exists" in capsys.readouterr().err and checksums(tmp_path) == before


# ---------------------------------------------------------------- loss spikes roll back


def _inject_spike_at(monkeypatch, call: int, factor: float = 100.0):
    """The step function reports a loss `factor` times too high on its `call`-th call (the update still happens,
    as a real spike's would): the trainer must roll back past it."""
    import meshformer.train.trainer as trainer_module

    real, calls = trainer_module.train_step, []

    def spiky(*a, **kw):
        r = real(*a, **kw)
        calls.append(1)
        if len(calls) == call:
            r.loss *= factor
        return r

    monkeypatch.setattr(trainer_module, "train_step", spiky)


def test_a_loss_spike_rolls_back_skips_its_batches_and_resumes_exactly(tiny_dataset, tmp_path, monkeypatch, capsys):
    spike = {"runner_wrapper.loss_spike_factor": 3.0, "callbacks": EVERY_STEP, "lr_schedule.total_steps": 30}
    _inject_spike_at(monkeypatch, 15)
    full = run(tiny_dataset, tmp_path / "full", **{"runner_config.stop_step": 30, **spike})
    log = capsys.readouterr().out
    assert "step 15: loss" in log and "rolled back to step_00000014 and skipped its 1 batch(es)" in log
    assert [r["step"] for r in full] == list(range(1, 31))  # the spiky step was never logged
    assert [r["rollbacks"] for r in full] == [0] * 14 + [1] * 16
    assert all(math.isfinite(r["loss"]) and r["loss"] < 7 for r in full) and full[-1]["loss"] < full[0]["loss"]
    state = json.loads((store.list_checkpoints(tmp_path / "full")[-1] / "trainer_state.json").read_text())
    assert state["data_offset"] == 1 and state["rollbacks"] == 1
    # The redone step 15 read the next batch: its loss differs from a run without the spike.
    monkeypatch.undo()
    plain = run(tiny_dataset, tmp_path / "plain", **{"runner_config.stop_step": 15, **spike})
    assert plain[13] == {**plain[13], "loss": full[13]["loss"]} and plain[14]["loss"] != full[14]["loss"]
    # Stopped after the rollback and resumed: the offset comes back from the checkpoint, bit for bit.
    _inject_spike_at(monkeypatch, 15)
    run(tiny_dataset, tmp_path / "split", **{"runner_config.stop_step": 20, **spike})
    monkeypatch.undo()
    resumed = run(tiny_dataset, tmp_path / "split", **{"runner_config.stop_step": 30, "resume_training": True, **spike})
    assert losses(resumed) == losses(full)
