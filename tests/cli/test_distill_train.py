"""A distillation run end to end through the trainer, on packed pretraining rows (the teacher reads the same
documents), with a meshformer run as its teacher: it resumes exactly (the teacher is loaded again, nothing of it is
saved with the student), the KD-trained student exports as a Hugging Face directory that transformers runs with
meshformer's logits, and a teacher of another vocabulary is refused by `train` in one line before anything is
written."""

from __future__ import annotations

import json

import pytest

from conftest import EMPTY, fails, save_hf_model, tiny_overrides
from meshformer.cli.main import main
from meshformer.cli.train_cmd import run_training
from meshformer.config import load_config

TEACHER_SHAPE = {"model.model_config.hidden_size": 48, "model.model_config.num_heads": 4}


def train(dataset, out, extra: dict) -> list[dict]:
    run_training(load_config(None, tiny_overrides(dataset, out, extra)))
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def teacher(tiny_dataset, tmp_path_factory):
    """A meshformer run of another width (its output_dir: the newest checkpoint is the teacher)."""
    out = tmp_path_factory.mktemp("teacher") / "run"
    train(tiny_dataset, out, {**TEACHER_SHAPE, "runner_config.stop_step": 3, "lr_schedule.total_steps": 3})
    return out


def distill(dataset, teacher, out, extra: dict) -> list[dict]:
    kd = {"distill_config.teacher": str(teacher), "distill_config.loss": "forward_kl", "distill_config.alpha": 0.5}
    return train(dataset, out, {**kd, "lr_schedule.total_steps": 4, **extra})


def test_a_distillation_run_resumes_exactly_and_exports(tiny_dataset, teacher, tmp_path, capsys):
    import torch
    import transformers

    from meshformer.interop.inference import load_for_inference

    full = distill(tiny_dataset, teacher, tmp_path / "full", {"runner_config.stop_step": 4})
    part = tmp_path / "part"
    distill(tiny_dataset, teacher, part, {"runner_config.stop_step": 2})
    resumed = distill(tiny_dataset, teacher, part, {"runner_config.stop_step": 4, "resume_training": True})
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(full, resumed):
        for key in ("loss", "grad_norm", "distill/divergence", "distill/ce"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
    assert full[0]["distill/divergence"] > 0.01 and full[-1]["distill/divergence"] < full[0]["distill/divergence"]
    for r in full:  # the loss is the alpha mix of the two logged means
        assert abs(r["loss"] - 0.5 * (r["distill/divergence"] + r["distill/ce"])) <= 1e-5 * r["loss"]

    assert main(["export", str(part), "--output", str(tmp_path / "hf")]) == 0
    ours, _, _ = load_for_inference(part)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    x = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = theirs(x).logits, ours(x)
    assert theirs.config.hidden_size == 32  # the student, not its teacher
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_teacher_of_another_vocabulary_is_one_line(tiny_dataset, tokenizer_dir, tmp_path, capsys):
    other = tmp_path / "other"
    save_hf_model(other, tokenizer_dir, {"vocab_size": 640, "hidden_size": 32, "intermediate_size": 64,
                                         "num_hidden_layers": 1, "num_attention_heads": 4})  # fmt: skip
    out = tmp_path / "run"
    argv = tiny_overrides(tiny_dataset, out, {"distill_config.teacher": str(other)})
    fails(capsys, ["train", EMPTY, *argv], "distill_config.teacher", "640 tokens", "student's 512")
    assert not out.exists()  # refused before the run directory was made
