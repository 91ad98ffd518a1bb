"""Every bad input is one line on stderr, exit code 2, no traceback, and changes no file that was there before.

Each class of bad input has at least three cases. Commands run in-process through the CLI entry point
(`meshformer.cli.main.main`), which is what the `meshformer` script calls: a UserError becomes one line and
exit code 2; any other exception would fail the test with its traceback.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import EMPTY, checksums, fails, tiny_overrides
from meshformer.checkpoint import manifest, store
from meshformer.cli.main import main


def train_argv(dataset: Path, out: Path, extra: dict | None = None, config: str = EMPTY) -> list[str]:
    return ["train", config, *tiny_overrides(dataset, out, extra)]


@pytest.fixture
def dataset_copy(tiny_dataset, tmp_path) -> Path:
    d = tmp_path / "data"
    d.mkdir()
    for f in tiny_dataset.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    return d


# ---------------------------------------------------------------- config files


@pytest.mark.parametrize(
    "content, needle",
    [
        (None, "is a directory"),
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "is binary, not YAML"),
        (b"model:\n  name: caf\xe9\n", "is not UTF-8 text (byte 18)"),
        (b"seed: 1\nrun_mode: train\nseed: 2\n", "key 'seed' appears twice in one section (lines 1 and 3)"),
        (
            b"optimizer:\n  learning_rate: 1.0e-4\n  beta1: 0.9\n  learning_rate: 3.0e-4\n",
            "'learning_rate' appears twice",
        ),
        (b"model:\n  model_config:\n    hidden_size: 64\n    hidden_size: 64\n", "'hidden_size' appears twice"),
        (b"model: [unclosed\n", "malformed YAML at line"),
        (b"- a\n- b\n", "the top level must be a mapping"),
    ],
)
def test_bad_config_files(tmp_path, capsys, content, needle):
    path = tmp_path / "cfg"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    before = checksums(tmp_path)
    fails(capsys, ["train", str(path), "--output_dir", str(tmp_path / "out")], needle)
    assert checksums(tmp_path) == before and not (tmp_path / "out").exists()


# ---------------------------------------------------------------- impossible sizes, before allocating


@pytest.mark.parametrize(
    "extra",
    [
        {"model.model_config.num_layers": 2_000_000},
        {"model.model_config.hidden_size": 409_600, "model.model_config.num_heads": 4},
        {"model.model_config.vocab_size": 5_000_000_000},
    ],
)
def test_impossible_sizes_fail_fast_with_the_bytes_needed(tiny_dataset, tmp_path, capsys, extra):
    extra = {**extra, "model.model_config.intermediate_size": None}
    extra = {k: v for k, v in extra.items() if v is not None}
    t0 = time.perf_counter()
    err = fails(capsys, train_argv(tiny_dataset, tmp_path / "out", extra), "parameters", "GiB per rank", "for a typo")
    assert time.perf_counter() - t0 < 5.0, "must fail before building or allocating anything"
    assert not list((tmp_path / "out").glob("checkpoint*")) and "need at least" in err


# ---------------------------------------------------------------- malformed dataset metadata


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda m: "[1, 2]", "meta.json is a JSON list"),
        (lambda m: "{not json", "corrupt meta.json"),
        (lambda m: json.dumps({**m, "dtype": "float64"}), "field 'dtype' is missing or malformed"),
        (lambda m: json.dumps({**m, "splits": {"train": {"tokens": "many"}}}), "field 'splits'"),
        (lambda m: json.dumps({k: v for k, v in m.items() if k != "vocab_size"}), "field 'vocab_size'"),
        (lambda m: json.dumps({**m, "format": "other"}), "is not 'meshformer-packed-v1'"),
    ],
)
def test_malformed_dataset_metadata(dataset_copy, tmp_path, capsys, edit, needle):
    meta = dataset_copy / "meta.json"
    meta.write_text(edit(json.loads(meta.read_text())))
    before = checksums(tmp_path)
    fails(capsys, train_argv(dataset_copy, tmp_path / "out"), needle, "re-run")
    assert checksums(tmp_path) == before


# ---------------------------------------------------------------- token ids beyond the vocabulary


def test_token_ids_beyond_the_vocabulary(dataset_copy, tmp_path, capsys):
    tokens = np.memmap(dataset_copy / "train.bin", dtype="<u2", mode="r+")
    tokens[:] = np.minimum(tokens, 511)
    tokens[100] = 60000  # a corrupt file: an id no tokenizer of this dataset made
    tokens.flush()
    fails(
        capsys,
        train_argv(
            dataset_copy, tmp_path / "a", {"runner_config.stop_step": 50, "train_dataset.data_loader.shuffle": False}
        ),
        "token id 60000",
        "vocab_size is 512",
    )
    fails(
        capsys,
        train_argv(dataset_copy, tmp_path / "b", {"model.model_config.vocab_size": 300}),
        "vocab_size=300 is smaller than the dataset's tokenizer vocabulary (512)",
    )
    fails(
        capsys,
        train_argv(dataset_copy, tmp_path / "c", {"model.model_config.vocab_size": 100}),
        "set vocab_size >= 512",
    )


# ---------------------------------------------------------------- malformed trainer_state.json


@pytest.mark.parametrize(
    "state, needle",
    [
        ("{oops", "trainer_state.json is missing or unreadable"),
        ("[3]", "trainer_state.json is not a JSON object"),
        ('{"step": -4}', "got -4"),
    ],
)
def test_malformed_trainer_state(tiny_dataset, tmp_path, capsys, state, needle):
    out = tmp_path / "run"
    assert main(train_argv(tiny_dataset, out, {"runner_config.stop_step": 1})) == 0
    ckpt = store.list_checkpoints(out)[-1]
    (ckpt / "trainer_state.json").write_text(state)
    manifest.write_manifest(ckpt)  # as if a buggy writer had saved it so: the manifest does not catch it
    before = checksums(tmp_path)
    fails(capsys, train_argv(tiny_dataset, out, {"runner_config.stop_step": 2, "resume_training": True}), needle)
    assert checksums(tmp_path) == before


# ---------------------------------------------------------------- an output path that is a file


def test_output_paths_that_are_files(tiny_dataset, tmp_path, capsys):
    f = tmp_path / "taken"
    f.write_text("mine")
    before = checksums(tmp_path)
    fails(capsys, train_argv(tiny_dataset, f), "output_dir=", "is a file")
    corpus = str(Path(__file__).resolve().parents[2] / "data" / "shakespeare" / "hamlet.txt")
    fails(capsys, ["preprocess", "--input", corpus, "--tokenizer", str(tiny_dataset), "--output", str(f)], "is a file")
    fails(capsys, ["tokenizer", "train", "--input", corpus, "--vocab-size", "300", "--output", str(f)], "taken")
    assert checksums(tmp_path) == before


# ---------------------------------------------------------------- an unavailable device


@pytest.mark.parametrize("local_rank, gpus", [(1, 1), (4, 2), (8, 4)])
def test_a_local_rank_without_a_gpu(monkeypatch, local_rank, gpus):
    import torch

    from meshformer.errors import UserError
    from meshformer.parallel.env import local_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    with pytest.raises(UserError, match=f"LOCAL_RANK={local_rank} but this node sees {gpus} GPU"):
        local_device()


# ---------------------------------------------------------------- overrides never swallow the next flag


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--output_dir", "--seed=7"], "override --output_dir has no value"),
        (["--seed", "3", "--output_dir"], "override --output_dir has no value"),
        (["--optimizer.learning_rate", "--seed", "3"], "override --optimizer.learning_rate has no value"),
    ],
)
def test_overrides_with_a_missing_value(tmp_path, capsys, args, needle):
    fails(capsys, ["train", EMPTY, *args], needle)
    assert not any(tmp_path.iterdir()) and not Path("--seed=7").exists()


# ---------------------------------------------------------------- config explain


@pytest.mark.parametrize(
    "prefix, hint",
    [
        ("paralel_config", "did you mean 'parallel_config"),
        ("optimizer.lerning", "did you mean 'optimizer.learning_rate'"),
        ("zzz", "run `meshformer config explain`"),
    ],
)
def test_unknown_explain_prefix(capsys, prefix, hint):
    fails(capsys, ["config", "explain", prefix], f"no field starts with {prefix!r}", hint)


# ---------------------------------------------------------------- fields that look meaningful


@pytest.mark.parametrize(
    "mode, needle", [("predict", "meshformer generate"), ("eval", "meshformer eval --checkpoint DIR --input FILE")]
)
def test_run_modes_that_do_not_train_are_refused(tiny_dataset, tmp_path, capsys, mode, needle):
    fails(capsys, train_argv(tiny_dataset, tmp_path / "o", {"run_mode": mode}), f"run_mode={mode}", needle)
    assert not (tmp_path / "o").exists()


def test_model_type_selects_the_family_defaults():
    from meshformer.config import load_config

    q2 = load_config(None, ["--model.model_config.type", "Qwen2Config"]).model.model_config
    q3 = load_config(None, ["--model.model_config.type", "Qwen3Config"]).model.model_config
    assert (q2.qkv_has_bias, q2.use_qk_norm) == (True, False) and (q3.qkv_has_bias, q3.use_qk_norm) == (False, True)
    off = load_config(None, ["--model.model_config.type", "Qwen2Config", "--model.model_config.qkv_has_bias", "false"])
    assert off.model.model_config.qkv_has_bias is False  # a field the user sets wins


def test_a_schedule_shorter_than_the_run_is_warned(tiny_dataset, tmp_path, capsys):
    assert (
        main(
            train_argv(
                tiny_dataset,
                tmp_path / "o",
                {"runner_config.stop_step": 4, "lr_schedule.total_steps": 2, "optimizer.warmup_steps": 0},
            )
        )
        == 0
    )
    assert "lr_schedule.total_steps=2 is shorter than the run (4 steps)" in capsys.readouterr().out


# ---------------------------------------------------------------- preprocess --overwrite never deletes inputs


def test_preprocess_overwrite_refuses_outputs_holding_inputs_or_foreign_files(tiny_dataset, tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    text = corpus / "a.txt"
    text.write_text("To be, or not to be, that is the question. " * 50)
    tok = tiny_dataset.parent / "tok"
    before = checksums(tmp_path)
    base = ["preprocess", "--input", str(text), "--tokenizer", str(tok), "--overwrite"]
    fails(capsys, [*base, "--output", str(corpus)], "contains", "a.txt", "would delete")
    fails(capsys, [*base, "--output", str(tmp_path)], "contains")
    assert checksums(tmp_path) == before
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.md").write_text("keep me")
    fails(capsys, [*base, "--output", str(mine)], "not a dataset written by `meshformer preprocess` (notes.md)")
    assert (mine / "notes.md").read_text() == "keep me"


def test_preprocess_removes_temp_dirs_of_killed_runs(tiny_dataset, tmp_path, capsys):
    text = tmp_path / "a.txt"
    text.write_text("Some words here. " * 200)
    stale = tmp_path / ".ds.tmp-999999999"  # no such process
    stale.mkdir()
    (stale / "train.bin").write_bytes(b"\0" * 1000)
    live = tmp_path / f".ds.tmp-{os.getppid()}"  # a running process's: left alone
    live.mkdir()
    assert (
        main(
            [
                "preprocess",
                "--input",
                str(text),
                "--tokenizer",
                str(tiny_dataset.parent / "tok"),
                "--output",
                str(tmp_path / "ds"),
            ]
        )
        == 0
    )
    assert (
        not stale.exists() and live.exists() and "left by a preprocess run that was killed" in capsys.readouterr().out
    )
