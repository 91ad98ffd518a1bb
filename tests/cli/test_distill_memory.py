"""The planner's memory for a distillation run against the memory meter (train/memory.py) on CPU: the student's
states and activations (the divergence's saved tensors in place of the cross-entropy's log-softmax: they depend on
the loss, top_k and alpha), the teacher's weights (a Hugging Face Llama of another width and depth), the logits its
forward leaves for the loss (one micro-batch's tokens x vocab in the compute dtype) and its forward's peak (its
head's, or a wide teacher's MLP's). The
tolerances are the SFT comparison's (tests/cli/test_memory.py). The pipeline-parallel case (all micro-batches'
logits kept on the last stage) and the other layouts: tests/parity/test_distill_layouts.py."""

from __future__ import annotations

import dataclasses
import json

import pytest

from conftest import TINY_HF_LLAMA, save_hf_model, tiny_overrides
from meshformer.cli.train_cmd import run_training
from meshformer.config import load_config
from meshformer.parallel.dims import ParallelDims
from meshformer.planner.accelerators import cpu_accelerator
from meshformer.planner.memory import plan_memory
from meshformer.planner.plan import make_plan
from test_memory import ACTIVATIONS_RTOL, STATES_RTOL, compare

TEACHER = {**TINY_HF_LLAMA, "hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 3}


WIDE = {"intermediate_size": 1024}  # a teacher whose MLP, not its head, is its forward's peak


@pytest.fixture(scope="module")
def teachers(tokenizer_dir, tmp_path_factory):
    """Hugging Face Llama teachers saved once: TEACHER (`narrow`) and TEACHER with WIDE's MLP (`wide`)."""
    root = tmp_path_factory.mktemp("teachers")
    for name, shape in {"narrow": TEACHER, "wide": {**TEACHER, **WIDE}}.items():
        save_hf_model(root / name, tokenizer_dir, shape)
    return root


CASES = {
    "forward_kl": {"distill_config.loss": "forward_kl"},
    "jsd, top_k, alpha, temperature": {
        "distill_config.loss": "jsd",
        "distill_config.top_k": 16,
        "distill_config.alpha": 0.5,
        "distill_config.temperature": 1.5,
    },
    "reverse_kl, bf16 autocast, top_k": {
        "distill_config.loss": "reverse_kl",
        "distill_config.top_k": 16,
        "model.model_config.compute_dtype": "bfloat16",
    },
    "forward_kl, wide teacher": {"distill_config.loss": "forward_kl"},
}


@pytest.mark.parametrize("name", list(CASES))
def test_planner_predicts_what_the_meter_measures_for_a_distillation_run(tiny_dataset, teachers, tmp_path, name):
    teacher = teachers / ("wide" if "wide" in name else "narrow")
    extra = {"distill_config.teacher": str(teacher), "runner_config.stop_step": 2, **CASES[name]}
    cfg = load_config(None, tiny_overrides(tiny_dataset, tmp_path / "run", extra))
    run_training(cfg)
    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    batch, accum = cfg.train_dataset.batch_size, cfg.runner_config.gradient_accumulation_steps
    stage = make_plan(cfg, ParallelDims.from_config(cfg, 1), cpu_accelerator(), batch, accum).stages[0]
    assert compare(last, stage.memory) == []  # the student, the divergence's saved tensors in its activations
    sft = dataclasses.replace(cfg, distill_config=type(cfg.distill_config)())
    tokens, vocab = batch * cfg.model.model_config.seq_length, cfg.model.model_config.vocab_size
    sft_activations = plan_memory(sft, ParallelDims.from_config(sft, 1), batch, accum)[0].activations_bytes
    assert stage.memory.activations_bytes >= sft_activations + tokens * vocab * 4  # at least the teacher's probs
    second = stage.second
    assert second.kind == "teacher"
    weights = last["mem_teacher_bytes"]
    assert weights > last["mem_params_bytes"]  # the teacher is the larger model
    assert abs(second.weights_bytes - weights) <= STATES_RTOL * weights
    compute = 2 if "bf16" in name else 4
    assert second.logits_bytes == tokens * vocab * compute  # one micro-batch's logits, in the compute dtype
    assert abs(last["mem_teacher_logits_bytes"] - second.logits_bytes) <= STATES_RTOL * second.logits_bytes
    forward = last["mem_teacher_forward_bytes"]
    assert forward >= second.logits_bytes and abs(second.forward_bytes - forward) <= ACTIVATIONS_RTOL * forward
    if "wide" in name:  # its MLP's three tokens x ffn tensors outweigh its logits
        assert forward > 3 * tokens * WIDE["intermediate_size"] * 4 > 2 * second.logits_bytes
    # on the CPU the meter's peak: the states, both models' weights, and the teacher's forward inside the loss,
    # beside the student's activations
    states = last["mem_params_bytes"] + last["mem_grads_bytes"] + last["mem_optim_bytes"]
    assert last["peak_mem_bytes"] == states + weights + last["mem_activations_bytes"] + forward
    assert json.loads((tmp_path / "run" / "memory.json").read_text())["0"]["teacher_logits_bytes"] > 0


def test_plan_prints_the_teachers_line(tiny_dataset, teachers, tmp_path, capsys):
    from conftest import EMPTY
    from meshformer.cli.main import main

    extra = {"distill_config.teacher": str(teachers / "narrow")}
    capsys.readouterr()
    assert main(["plan", EMPTY, *tiny_overrides(tiny_dataset, tmp_path / "run", extra), "--accelerator", "cpu"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    line = out[out.index("teacher: frozen weights") :]
    assert (
        "GiB kept for the loss, its no_grad forward" in line and "beside the student's (in the logits column)" in line
    )
