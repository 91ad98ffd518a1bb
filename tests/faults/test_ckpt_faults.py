"""Hostile or damaged files are checked for what they are, not only against a manifest: a shard swapped in with a
manifest rewritten to match is a bad checkpoint (resume falls back, every command says one line naming it); no
path from a manifest or a model index leaves its folder (and nothing outside is read); a pickled or broken
`pytorch_model.bin` is one line; `ckpt merge` parses its flags and writes a directory transformers and
`load_checkpoint` take, holding the checkpoint's own tensors."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import TINY_HF_LLAMA, checksums, save_hf_model, tiny_overrides
from meshformer.checkpoint import manifest, store
from meshformer.cli.main import main
from meshformer.cli.train_cmd import run_training  # load_checkpoint: a Hugging Face directory
from meshformer.config import load_config

transformers = pytest.importorskip("transformers")

EVERY_STEP = "[{type: MFLossMonitor, per_print_times: 100}, {type: CheckpointMonitor, save_checkpoint_steps: 1}]"
SHARD = "model/shard-00001-model-00001-of-00001.safetensors"


def train(dataset: Path, out: Path, **extra) -> list[dict]:
    extra = {"lr_schedule.total_steps": 6, "callbacks": EVERY_STEP, **extra}
    run_training(load_config(None, tiny_overrides(dataset, out, extra)))
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(tiny_dataset, tmp_path_factory) -> tuple[Path, list[dict]]:
    """A run of 2 steps saving each step (never modified: tests copy it)."""
    out = tmp_path_factory.mktemp("faults") / "run"
    return out, train(tiny_dataset, out, **{"runner_config.stop_step": 2})


def copy_run(trained, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(trained[0], run)
    (run / ".lock").unlink(missing_ok=True)
    return run


def one_line(capsys, *names: str) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("meshformer: error: ") and "\n" not in err and "Traceback" not in err, err
    assert all(n in err for n in names), (names, err)
    return err


def forge(shard: Path, how: str) -> None:
    """Replace a shard and rewrite the manifest to match it (size and hash), as a buggy or hostile writer would."""
    if how == "random bytes":
        shard.write_bytes(os.urandom(shard.stat().st_size))
    else:  # valid safetensors, but embed_tokens is the second half of a 2-way split (another layout's shard)
        from safetensors import safe_open

        with safe_open(str(shard), framework="pt") as f:
            tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
        tensors["embed_tokens.weight"] = tensors["embed_tokens.weight"][256:].clone()
        offsets = json.loads(meta["DCP_SHARDING_INFO"])
        offsets["embed_tokens.weight"]["saved_offsets"] = [256, 0]
        save_file(tensors, str(shard), metadata={**meta, "DCP_SHARDING_INFO": json.dumps(offsets)})
    manifest.write_manifest(shard.parent.parent)


@pytest.mark.parametrize("how", ["random bytes", "foreign shard map"])
def test_forged_shard_with_matching_manifest_is_a_bad_checkpoint(trained, tiny_dataset, tmp_path, capsys, how):
    run = copy_run(trained, tmp_path)
    step2 = store.checkpoint_root(run) / "step_00000002"
    forge(step2 / SHARD, how)
    capsys.readouterr()
    assert main(["ckpt", "verify", str(run)]) == 1
    out = capsys.readouterr().out
    assert "step_00000001: ok" in out and "step_00000002: BAD: " in out
    assert (SHARD if how == "random bytes" else "'embed_tokens.weight': its shards do not cover") in out
    before = checksums(tmp_path)
    commands = {
        "generate": ["generate", "--checkpoint", str(step2), "--prompt", "to be", "--max-new-tokens", "2"],
        "merge": ["ckpt", "merge", str(step2), "--output", str(tmp_path / "merged")],
        "export": ["export", str(step2), "--output", str(tmp_path / "exported")],
    }
    for name, argv in commands.items():
        assert main(argv) == 2, name
        one_line(capsys, "step_00000002", "is not usable")
    assert checksums(tmp_path) == before  # nothing written beside the run, nothing changed in it
    if how == "random bytes":  # resume skips it, naming why, and continues exactly from step 1
        resumed = train(tiny_dataset, run, **{"runner_config.stop_step": 2, "resume_training": True})
        logged = capsys.readouterr()
        assert f"skipped checkpoint {step2}: {SHARD} is not a valid safetensors file" in logged.out + logged.err
        assert [r["loss"] for r in resumed] == [r["loss"] for r in trained[1]]


def test_manifest_entries_outside_the_checkpoint_are_refused_unread(trained, tmp_path, capsys, monkeypatch):
    run = copy_run(trained, tmp_path)
    step1 = store.checkpoint_root(run) / "step_00000001"
    secret = run / "checkpoint" / "secret"  # `../../secret` from inside step_00000001/model
    secret.write_bytes(b"not yours")
    entry = {"bytes": secret.stat().st_size, "sha256": manifest.file_sha256(secret)}  # it would pass the checks
    original = (step1 / manifest.MANIFEST).read_text()
    hashed: list[Path] = []
    real_sha = manifest.file_sha256
    monkeypatch.setattr(manifest, "file_sha256", lambda p: hashed.append(Path(p).resolve()) or real_sha(p))
    for name in ("model/../../secret", str(secret)):
        m = json.loads(original)
        m["files"][name] = entry
        (step1 / manifest.MANIFEST).write_text(json.dumps(m))
        why = manifest.verify(step1)
        assert why is not None and why.startswith(f"manifest.json entry {name!r}"), why
        assert main(["ckpt", "verify", str(step1)]) == 1
        assert f"BAD: manifest.json entry {name!r}" in capsys.readouterr().out
    assert secret.resolve() not in hashed and secret.read_bytes() == b"not yours"

    (step1 / manifest.MANIFEST).write_text(original)  # a shard that is a symlink out, its bytes identical
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(step1 / SHARD, outside)
    (step1 / SHARD).symlink_to(outside)
    assert "is a symlink pointing outside" in manifest.verify(step1)
    (step1 / SHARD).unlink()
    shutil.copy(outside, step1 / SHARD)
    assert manifest.verify(step1) is None  # the same bytes in place are a good checkpoint again
    shutil.copy(outside, step1 / "model" / "extra.safetensors")  # DCP's reader would take it
    assert manifest.verify(step1) == "model/extra.safetensors is not in the manifest (a foreign file)"


def hf_dir(out: Path, tok_dir: Path, shard: str | None = "60KB") -> transformers.LlamaForCausalLM:
    """The tiny dataset's model shape at transformers' init (no spread), saved in shards of `shard` if given."""
    config = {**TINY_HF_LLAMA, "max_position_embeddings": 64, "rms_norm_eps": 1e-6}
    return save_hf_model(out, tok_dir, config, spread=0, shard=shard)


def test_index_paths_stay_inside_the_model_directory(tiny_dataset, tmp_path, capsys):
    tok = tiny_dataset.parent / "tok"
    good = tmp_path / "good"
    hf_dir(good, tok)
    index = json.loads((good / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    shutil.copy(good / first, tmp_path / "x.safetensors")  # a real shard outside: the old code imported it
    cases = {"dotdot": "../x.safetensors", "absolute": str(tmp_path / "x.safetensors"), "symlink": first}
    for name, target in cases.items():
        d = tmp_path / name
        shutil.copytree(good, d)
        if name == "symlink":
            (d / first).unlink()
            (d / first).symlink_to(tmp_path / "x.safetensors")
        else:
            moved = {k: (target if v == first else v) for k, v in index["weight_map"].items()}
            (d / "model.safetensors.index.json").write_text(json.dumps({**index, "weight_map": moved}))
            (d / first).unlink()
        before = checksums(tmp_path)
        capsys.readouterr()
        assert main(["import", str(d), "--output", str(tmp_path / f"out_{name}")]) == 2, name
        one_line(capsys, repr(target), "must be inside it")
        assert checksums(tmp_path) == before and not list(tmp_path.glob(f"out_{name}*")), name

    # A hub cache snapshot links into its repository's blobs/: that is inside, and imports.
    repo = tmp_path / "hub" / "models--t--tiny"
    snap = repo / "snapshots" / "abc123"
    shutil.copytree(good, snap)
    (repo / "blobs").mkdir()
    for f in sorted(snap.glob("*.safetensors")):
        shutil.move(f, repo / "blobs" / f.name)
        f.symlink_to(Path("../..") / "blobs" / f.name)
    assert main(["import", str(snap), "--output", str(tmp_path / "from_cache")]) == 0


class RunsCode:
    """Unpickling this would run a shell command; torch.load(weights_only=True) must refuse it."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickled_or_broken_pytorch_bin_is_one_line(tiny_dataset, tmp_path, capsys):
    d = tmp_path / "hf"
    model = hf_dir(d, tiny_dataset.parent / "tok", shard=None)
    (d / "model.safetensors").unlink()
    marker = tmp_path / "code_ran"
    torch.save({**model.state_dict(), "x": RunsCode(marker)}, d / "pytorch_model.bin")
    capsys.readouterr()
    assert main(["import", str(d), "--output", str(tmp_path / "out")]) == 2
    one_line(capsys, "pytorch_model.bin", "never unpickles", "convert it to safetensors")
    assert not marker.exists() and not (tmp_path / "out").exists()
    for broken in (b"", b"garbage" * 40, (d / "pytorch_model.bin").read_bytes()[:400]):
        (d / "pytorch_model.bin").write_bytes(broken)
        assert main(["import", str(d), "--output", str(tmp_path / "out")]) == 2
        one_line(capsys, "pytorch_model.bin", "not a readable PyTorch weights file")


def test_merge_flags_parse_and_its_directory_loads_as_the_checkpoint(trained, tiny_dataset, tmp_path, capsys):
    run = copy_run(trained, tmp_path)
    step2 = store.checkpoint_root(run) / "step_00000002"
    merged = tmp_path / "merged"
    assert main(["ckpt", "merge", str(run), "--output", str(merged), "--optimizer"]) == 0
    assert "optimizer tensors" in capsys.readouterr().out
    saved, weights = load_file(step2 / SHARD), load_file(merged / "model.safetensors")
    assert sorted(weights) == sorted(k if k == "lm_head.weight" else f"model.{k}" for k in saved)
    assert all(torch.equal(weights[k if k == "lm_head.weight" else f"model.{k}"], v) for k, v in saved.items())
    optim, saved_optim = load_file(merged / "optimizer.safetensors"), load_file(next((step2 / "optim").iterdir()))
    assert len(optim) == len(saved_optim)
    assert torch.equal(optim["state.model.norm.weight.exp_avg"], saved_optim["state.norm.weight.exp_avg"])

    from meshformer.interop.inference import load_for_inference

    ours, _, _ = load_for_inference(step2)  # transformers loads the directory as the checkpoint's model
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(merged, output_loading_info=True)
    assert not any(info.values()), info
    x = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(theirs.eval()(x).logits, ours(x), rtol=1e-5, atol=1e-5)

    # load_checkpoint takes it: the first step from it is the first step from the checkpoint itself.
    common = {"runner_config.stop_step": 1, "callbacks": "[{type: MFLossMonitor, per_print_times: 100}]"}
    from_merged = train(tiny_dataset, tmp_path / "a", load_checkpoint=str(merged), **common)
    from_ckpt = train(tiny_dataset, tmp_path / "b", load_checkpoint=str(step2), **common)
    assert from_merged[0]["loss"] == from_ckpt[0]["loss"]

    capsys.readouterr()
    before = checksums(merged)
    assert main(["ckpt", "merge", str(run), "--output", str(merged)]) == 2  # no silent overwrite
    one_line(capsys, "already exists", "--overwrite")
    assert main(["ckpt", "merge", str(run), "--output", str(tmp_path / "m.safetensors")]) == 2
    one_line(capsys, "merge writes a Hugging Face model directory")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "mine.txt").write_text("keep")
    assert main(["ckpt", "merge", str(run), "--output", str(tmp_path / "notes"), "--overwrite"]) == 2
    one_line(capsys, "--overwrite replaces only a merge's output")
    assert checksums(merged) == before and (tmp_path / "notes" / "mine.txt").read_text() == "keep"
    assert main(["ckpt", "merge", str(run), "--output", str(merged), "--overwrite"]) == 0
    assert not (merged / "optimizer.safetensors").exists() and torch.equal(
        load_file(merged / "model.safetensors")["model.norm.weight"], saved["norm.weight"]
    )
    assert sorted(p.name for p in tmp_path.iterdir() if "merge" in p.name) == ["merged"]  # no leftovers
