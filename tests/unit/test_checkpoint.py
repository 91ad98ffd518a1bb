"""Checkpoints and resume: what a save holds, what a resume checks, and what is never overwritten."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_overrides
from meshformer.config import load_config
from meshformer.errors import UserError
from meshformer.train.trainer import run_training


def train(dataset, out, extra=None):
    run_training(load_config(None, tiny_overrides(dataset, out, extra)))
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_two_stage_parts_save_and_load_their_optimizer_states(tmp_path):
    """A rank holding several pipeline stages (interleaved / V schedules) keeps one optimizer per stage."""
    from meshformer.checkpoint import store
    from meshformer.checkpoint.saver import save_checkpoint
    from meshformer.models import build_model, materialize
    from meshformer.parallel.pipeline import split_pipeline
    from meshformer.train.optim import Optimizers

    cfg = load_config(
        None,
        [
            "--model.model_config.hidden_size",
            "16",
            "--model.model_config.num_layers",
            "4",
            "--model.model_config.num_heads",
            "2",
            "--model.model_config.vocab_size",
            "32",
            "--model.model_config.seq_length",
            "8",
            "--parallel_config.pipeline_stage",
            "2",
            "--parallel_config.micro_batch_num",
            "2",
            "--parallel_config.pipeline_schedule",
            "interleaved_1f1b",
            "--parallel_config.pp_interleave_num",
            "2",
        ],
    )

    def stages():
        parts = [m for _, m in split_pipeline(build_model(cfg.model.model_config), cfg, 0)]
        for p in parts:
            materialize(p, "cpu", 0)
        return parts

    parts = stages()
    assert len(parts) == 2  # stages 0 and 2 live on pp rank 0
    opts = Optimizers(parts, cfg)
    for p in parts:
        for w in p.parameters():
            w.grad = torch.randn_like(w)
    opts.step()
    save_checkpoint(tmp_path / "step_1", parts, opts.items, {"step": 1}, {})
    fresh = stages()
    fresh_opts = Optimizers(fresh, cfg)
    store.load_model_weights(tmp_path / "step_1", fresh)
    store.load_optimizer(tmp_path / "step_1", fresh, fresh_opts.items)
    for a, b in zip(opts.state_tensors(), fresh_opts.state_tensors()):
        assert torch.equal(a, b)
    for (na, a), (nb, b) in zip(parts[1].named_parameters(), fresh[1].named_parameters()):
        assert na == nb and torch.equal(a, b)


def test_resuming_another_runs_checkpoint_never_touches_an_existing_run(tiny_dataset, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    train(tiny_dataset, a, {"runner_config.stop_step": 2})
    train(tiny_dataset, b, {"runner_config.stop_step": 3})
    before = (b / "metrics.jsonl").read_text()
    with pytest.raises(UserError, match="already holds a run"):
        train(tiny_dataset, b, {"runner_config.stop_step": 4, "resume_training": True, "load_checkpoint": str(a)})
    assert (b / "metrics.jsonl").read_text() == before


def test_resume_refuses_a_changed_data_position(tiny_dataset, tmp_path):
    out = tmp_path / "run"
    train(tiny_dataset, out, {"runner_config.stop_step": 2})
    with pytest.raises(UserError, match="seq_length=32 but this config gives 16"):
        train(
            tiny_dataset,
            out,
            {"runner_config.stop_step": 4, "resume_training": True, "model.model_config.seq_length": 16},
        )
    with pytest.raises(UserError, match="global_batch=4 but this config gives 8"):
        train(tiny_dataset, out, {"runner_config.stop_step": 4, "resume_training": True, "train_dataset.batch_size": 8})


def test_resume_survives_a_metrics_line_cut_off_by_a_crash(tiny_dataset, tmp_path):
    out = tmp_path / "run"
    common = {"lr_schedule.total_steps": 4}
    train(tiny_dataset, out, {**common, "runner_config.stop_step": 2})
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "loss": 5.1')  # the process died mid-write after the checkpoint at step 2
    recs = train(tiny_dataset, out, {**common, "runner_config.stop_step": 4, "resume_training": True})
    assert [r["step"] for r in recs] == [1, 2, 3, 4]


def test_checkpoint_that_does_not_fit_the_model_is_one_line(tiny_dataset, tmp_path):
    out = tmp_path / "run"
    train(tiny_dataset, out, {"runner_config.stop_step": 1})
    with pytest.raises(UserError, match="does not fit this model") as e:
        train(
            tiny_dataset,
            tmp_path / "other",
            {"runner_config.stop_step": 1, "load_checkpoint": str(out), "model.model_config.hidden_size": 64},
        )
    assert "\n" not in str(e.value)


def test_parameters_are_stored_in_param_init_type():
    from meshformer.models import create_model

    cfg = load_config(
        None,
        [
            "--model.model_config.hidden_size",
            "16",
            "--model.model_config.num_layers",
            "1",
            "--model.model_config.num_heads",
            "2",
            "--model.model_config.vocab_size",
            "32",
            "--model.model_config.seq_length",
            "8",
            "--model.model_config.param_init_type",
            "bfloat16",
            "--model.model_config.compute_dtype",
            "bfloat16",
        ],
    )
    model = create_model(cfg.model.model_config, 0)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rope.cos.dtype == torch.float32  # rotary tables keep rotary_dtype


def test_full_weights_reach_compiled_layers_by_their_checkpoint_names():
    """A compiled layer's parameters are named `layers.N._orig_mod.*` in its module; full tensors (a Hugging Face
    model's, a distillation teacher's) come under checkpoint names and must still land in it (compile is on by
    default on a GPU). Wrapping compiles nothing until a forward, so this costs no compile."""
    from meshformer.checkpoint import store
    from meshformer.models import build_model, materialize
    from meshformer.models.init import canonical_name

    args = {"hidden_size": 16, "num_layers": 2, "num_heads": 2, "vocab_size": 32, "seq_length": 8}
    cfg = load_config(None, [x for k, v in args.items() for x in (f"--model.model_config.{k}", str(v))])
    model = build_model(cfg.model.model_config)
    for key in list(model.layers.keys()):
        model.layers[key] = torch.compile(model.layers[key])
    materialize(model, torch.device("cpu"), 0, torch.float32)
    assert any("_orig_mod." in name for name in model.state_dict())
    tensors = {canonical_name(k): torch.full_like(v, 0.5) for k, v in model.state_dict().items()}
    store.load_full_weights([model], tensors)
    assert all(bool((v == 0.5).all()) for v in model.state_dict().values())
