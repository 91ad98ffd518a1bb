"""LoRA as a model transform: PEFT-compatible adapters proven against `peft`, merged exports against the adapter,
frozen base weights, an optimizer that holds only the adapters, and the MindSpore spellings of the config.
(Parallel layouts: the `lora` variant of the parity suite, tests/parity/test_parallel.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import TINY_HF_LLAMA, save_hf_model, tiny_overrides, tokens
from meshformer.cli.main import main
from meshformer.cli.train_cmd import run_training  # load_checkpoint: a Hugging Face directory
from meshformer.config import load_config
from meshformer.errors import UserError
from meshformer.interop.inference import load_for_inference
from meshformer.models import build_model
from meshformer.models.lora import LoRALinear, apply_lora

peft = pytest.importorskip("peft")
LORA = {
    "model.model_config.pet_config.pet_type": "lora",
    "model.model_config.pet_config.lora_rank": 4,
    "model.model_config.pet_config.lora_alpha": 8,
    "model.model_config.pet_config.target_modules": ".*wq|.*wv|.*w2",  # MindSpore's names for q, v, down
    "model.model_config.rms_norm_eps": 1e-5,
    "optimizer.learning_rate": 1e-2,
}


@pytest.fixture(scope="module")
def lora_run(tiny_dataset, tmp_path_factory):
    """A LoRA fine-tune of a transformers-made Llama: its directory, the base model and the run directory."""
    root = tmp_path_factory.mktemp("lora")
    base = save_hf_model(root / "hf", tiny_dataset.parent / "tok", TINY_HF_LLAMA, shard="100KB")
    extra = {**LORA, "load_checkpoint": str(root / "hf"), "runner_config.stop_step": 6}
    run_training(load_config(None, tiny_overrides(tiny_dataset, root / "run", extra)))
    original = {k.removeprefix("model."): v.clone() for k, v in base.state_dict().items()}
    return root, base, original  # (peft wraps `base` in place: keep its weights as they were)


def test_exported_adapter_matches_peft_and_the_merged_model(lora_run):
    root, base, _ = lora_run
    ours, _, _ = load_for_inference(root / "run")
    assert main(["export", str(root / "run"), "--output", str(root / "adapter")]) == 0
    cfg = json.loads((root / "adapter" / "adapter_config.json").read_text())
    assert (
        cfg["peft_type"] == "LORA"
        and cfg["r"] == 4
        and sorted(cfg["target_modules"])
        == [
            "down_proj",
            "q_proj",
            "v_proj",
        ]
    )
    assert cfg["base_model_name_or_path"] == str(root / "hf")
    x = tokens()
    with torch.no_grad():
        want = ours(x)
        assert (want - base(x).logits).abs().max() > 1e-3  # the adapters learned something
        adapted = peft.PeftModel.from_pretrained(base, root / "adapter").eval()
        torch.testing.assert_close(adapted(x).logits, want, rtol=1e-4, atol=1e-4)
    assert main(["export", str(root / "run"), "--output", str(root / "merged"), "--merge-lora", "--verify"]) == 0
    import transformers

    merged = transformers.AutoModelForCausalLM.from_pretrained(root / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(x).logits, want, rtol=1e-4, atol=1e-4)


def test_only_the_adapters_train(lora_run):
    root, _, original = lora_run
    ckpt = sorted((root / "run" / "checkpoint").iterdir())[-1]
    saved = load_file(next((ckpt / "model").glob("*.safetensors")))
    frozen = [k for k in saved if "lora_" not in k]
    assert len(frozen) == len(original) and any(".base_layer." in k for k in frozen)
    for k in frozen:  # every base weight, bit for bit as loaded
        assert torch.equal(saved[k], original[k.replace(".base_layer.", ".")]), k
    assert all(saved[k].abs().max() > 0 for k in saved if "lora_B" in k)  # B started at zero and moved
    optim = load_file(next((ckpt / "optim").glob("*.safetensors")))
    assert optim and all("lora_" in k for k in optim)  # optimizer state for the adapters only


def test_target_modules_spellings_and_errors():
    def wrapped(targets) -> list[str]:
        cfg = load_config(None, ["--model.model_config.num_layers", "1", "--model.model_config.hidden_size", "64"])
        cfg.model.model_config.pet_config.target_modules = targets
        model = build_model(cfg.model.model_config)
        apply_lora(model, cfg)
        return sorted(n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, LoRALinear))

    assert wrapped(".*wq|.*wk|.*wv|.*wo") == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert wrapped(["w1", "w3", "down_proj"]) == ["down_proj", "gate_proj", "up_proj"]
    assert wrapped(".*layers.0.mlp.*") == ["down_proj", "gate_proj", "up_proj"]
    with pytest.raises(UserError, match="matches no decoder linear .*their names: .*q_proj"):
        wrapped(".*query")
    with pytest.raises(UserError, match="not a valid regex"):
        wrapped(".*q_proj(")


def test_pet_method_short_form_turns_lora_on(tmp_path):
    cfg = load_config(None, ["--model.model_config.pet_method", "lora"])
    assert cfg.model.model_config.pet_config.pet_type == "lora"
    notices: list[str] = []
    mindspore = (
        Path(__file__).resolve().parents[3] / "shared/reference/mindformers-configs/r1.5.0__llama2__lora_llama2_7b.yaml"
    )
    cfg = load_config(mindspore, notices=notices)
    pc = cfg.model.model_config.pet_config
    assert (pc.pet_type, pc.lora_rank, pc.lora_alpha, pc.target_modules) == ("lora", 16, 16, ".*wq|.*wk|.*wv|.*wo")
