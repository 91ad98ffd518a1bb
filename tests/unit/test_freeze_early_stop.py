"""Freezing by parameter-name pattern, and early stopping on the validation loss with the best checkpoint kept."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from conftest import tiny_overrides
from meshformer.config import load_config
from meshformer.errors import UserError
from meshformer.train.trainer import run_training

EVERY_STEP = "[{type: MFLossMonitor, per_print_times: 100}, {type: CheckpointMonitor, save_checkpoint_steps: 1, keep_checkpoint_max: 1}]"  # noqa: E501


def weights(run):
    ckpt = sorted((run / "checkpoint").iterdir())[-1]
    return load_file(next((ckpt / "model").glob("*.safetensors"))), ckpt


def test_frozen_parameters_do_not_move_and_have_no_optimizer_state(tiny_dataset, tmp_path):
    base = tmp_path / "base"
    run_training(load_config(None, tiny_overrides(tiny_dataset, base, {"runner_config.stop_step": 1})))
    freeze = {
        "load_checkpoint": str(base),
        "runner_config.stop_step": 3,
        "model.model_config.pet_config.freeze_include": "['embed_tokens.*', 'layers.0.*']",
        "model.model_config.pet_config.freeze_exclude": "['layers.0.mlp.*']",
    }
    run_training(load_config(None, tiny_overrides(tiny_dataset, tmp_path / "run", freeze)))
    before, _ = weights(base)
    after, ckpt = weights(tmp_path / "run")
    frozen = [k for k in after if k.startswith(("embed_tokens.", "layers.0.")) and not k.startswith("layers.0.mlp.")]
    assert frozen and all((after[k] == before[k]).all() for k in frozen)
    moved = [k for k in after if k not in frozen]
    assert all(not (after[k] == before[k]).all() for k in moved if k.endswith("proj.weight"))
    optim = load_file(next((ckpt / "optim").glob("*.safetensors")))
    assert not any(k.split(".", 1)[1].startswith(tuple(frozen)) for k in optim)
    with pytest.raises(UserError, match="freeze_include=.*matches no parameter"):
        bad = {**freeze, "model.model_config.pet_config.freeze_include": "['decoder.*']"}
        run_training(load_config(None, tiny_overrides(tiny_dataset, tmp_path / "bad", bad)))


def test_early_stopping_stops_and_keeps_the_best_checkpoint(tiny_dataset, tmp_path):
    out = tmp_path / "run"
    extra = {
        "runner_config.stop_step": 60,
        "runner_config.early_stopping_patience": 2,
        "eval_config.eval_interval": 1,
        "eval_config.eval_iters": 1,
        "optimizer.learning_rate": 0.3,  # far too high: the validation loss soon stops improving
        "optimizer.warmup_steps": 0,
        "callbacks": EVERY_STEP,
    }
    run_training(load_config(None, tiny_overrides(tiny_dataset, out, extra)))
    recs = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval_loss"] for r in recs]
    best = min(range(len(evals)), key=evals.__getitem__)
    assert len(recs) < 60 and len(recs) == best + 1 + 2  # stopped two evaluations after the best
    kept = {p.name: json.loads((p / "trainer_state.json").read_text()) for p in (out / "checkpoint").iterdir()}
    best_ckpt = [s for s in kept.values() if s.get("best")]
    assert len(best_ckpt) == 1 and best_ckpt[0]["step"] == best + 1  # kept although keep_checkpoint_max is 1
    assert abs(best_ckpt[0]["best_eval_loss"] - evals[best]) < 1e-9
