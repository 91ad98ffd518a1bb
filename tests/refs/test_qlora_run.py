"""A QLoRA fine-tune end to end: from a Hugging Face directory, resumed exactly, its adapter exported as a PEFT
adapter that applies to the original unquantized base."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import TINY_HF_LLAMA, save_hf_model, tiny_overrides, tokens
from meshformer.cli.main import main
from meshformer.cli.train_cmd import run_training  # load_checkpoint: a Hugging Face directory
from meshformer.config import load_config
from meshformer.interop.inference import load_for_inference
from meshformer.models.lora import base_name
from meshformer.models.qlora import dequantized_state_dict
from meshformer.models.registry import family_of

peft = pytest.importorskip("peft")
QLORA = {
    "model.model_config.pet_method": "qlora",
    "model.model_config.pet_config.lora_rank": 4,
    "model.model_config.pet_config.target_modules": "[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]",
    "optimizer.learning_rate": 1e-2,
    "lr_schedule.total_steps": 8,
    "callbacks": "[{type: CheckpointMonitor, save_checkpoint_steps: 4}]",
}


def _metrics(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _train(dataset, run, extra) -> list[dict]:
    run_training(load_config(None, tiny_overrides(dataset, run, {**QLORA, **extra})))
    return _metrics(run)


@pytest.fixture(scope="module")
def qlora_run(tiny_dataset, tmp_path_factory):
    root = tmp_path_factory.mktemp("qlora")
    base = save_hf_model(root / "hf", tiny_dataset.parent / "tok", TINY_HF_LLAMA)
    hf = {"load_checkpoint": str(root / "hf")}
    full = _train(tiny_dataset, root / "full", {**hf, "runner_config.stop_step": 8})
    _train(tiny_dataset, root / "part", {**hf, "runner_config.stop_step": 5})  # checkpoints at 4 and 5
    resumed = _train(tiny_dataset, root / "part", {**hf, "runner_config.stop_step": 8, "resume_training": "auto"})
    return root, base, full, resumed


def test_a_resumed_qlora_run_equals_the_uninterrupted_one(qlora_run):
    _, _, full, resumed = qlora_run
    assert [r["step"] for r in resumed] == list(range(1, 9))
    for a, b in zip(full, resumed):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"], (a, b)
    assert full[-1]["loss"] < full[0]["loss"]


def test_the_exported_adapter_applies_to_the_unquantized_base(qlora_run):
    import transformers

    root, base, _, _ = qlora_run
    assert main(["export", str(root / "full"), "--output", str(root / "adapter")]) == 0
    ours, _, _ = load_for_inference(root / "full")  # the NF4 base, quantized again from the Hugging Face directory
    x = tokens()
    with torch.no_grad():
        exact = base(x).logits
        adapted = peft.PeftModel.from_pretrained(base, root / "adapter").eval()  # the original, unquantized base
        assert (adapted(x).logits - exact).abs().max() > 1e-3  # every adapter key found its layer, and learned
        # The same adapter over the base holding our dequantized NF4 weights is our model exactly.
        mc = ours.config
        state = {base_name(k): v for k, v in dequantized_state_dict(ours).items() if base_name(k) is not None}
        dequantized = transformers.AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32)
        dequantized.load_state_dict(family_of(mc).to_hf_state(state, mc))
        theirs = peft.PeftModel.from_pretrained(dequantized.eval(), root / "adapter").eval()
        torch.testing.assert_close(theirs(x).logits, ours(x), rtol=1e-4, atol=1e-4)
    # --merge-lora folds the adapters into the dequantized base: a plain model with our logits
    assert main(["export", str(root / "full"), "--output", str(root / "merged"), "--merge-lora"]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(root / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(x).logits, ours(x), rtol=1e-4, atol=1e-4)
