"""A DPO-trained model exports like any fine-tune: a full DPO run to a Hugging Face directory that transformers loads
with meshformer's logits, and to a GGUF file holding the same tensors (F32); a LoRA DPO run (`reference: adapter`)
to a PEFT adapter that `peft.AutoPeftModelForCausalLM` loads from its folder with meshformer's logits."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from conftest import LORA, dpo_overrides, preference_run_dir, tokens
from meshformer.cli.main import main
from meshformer.cli.train_cmd import run_training  # load_checkpoint: a Hugging Face directory
from meshformer.config import load_config
from meshformer.interop.inference import load_for_inference

transformers = pytest.importorskip("transformers")

RECORDS = [{"prompt": f"Line {i} says", "chosen": f" yes {i}", "rejected": " no"} for i in range(8)]


@pytest.fixture(scope="module")
def setup(tiny_dataset, tmp_path_factory):
    return preference_run_dir(tmp_path_factory.mktemp("dpo_export"), tiny_dataset.parent / "tok", RECORDS, 0.0)


def train(root, out, extra: dict) -> None:
    extra = {"runner_config.stop_step": 3, "optimizer.learning_rate": 1e-2, **extra}
    run_training(load_config(None, dpo_overrides(root, out, extra)))


def check_loads(run, root, load) -> None:
    """`load()`'s logits equal meshformer's of `run`, which left the starting weights (root's Hugging Face model)."""
    ours, _, _ = load_for_inference(run)
    x = tokens()
    with torch.no_grad():
        want = ours(x)
        base = transformers.AutoModelForCausalLM.from_pretrained(str(root / "hf"), dtype=torch.float32)
        assert (want - base(x).logits).abs().max() > 1e-3  # DPO moved the weights
        torch.testing.assert_close(load().eval()(x).logits, want, rtol=1e-4, atol=1e-4)


def test_full_dpo_exports_to_transformers_and_gguf(setup, tmp_path):
    train(setup, tmp_path / "run", {})
    assert main(["export", str(tmp_path / "run"), "--output", str(tmp_path / "hf")]) == 0
    auto = transformers.AutoModelForCausalLM
    check_loads(tmp_path / "run", setup, lambda: auto.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32))

    pytest.importorskip("gguf")
    from meshformer.interop.gguf_read import read_gguf

    gguf_file = tmp_path / "dpo.gguf"
    assert (
        main(["export", str(tmp_path / "run"), "--output", str(gguf_file), "--format", "gguf", "--gguf-type", "F32"])
        == 0
    )
    exported = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        exported.update(load_file(str(f)))
    got = read_gguf(gguf_file).tensors
    assert set(exported) <= set(got) | {"lm_head.weight"}
    for name, t in exported.items():
        if name in got:
            assert torch.equal(got[name].float(), t.float()), name


def test_lora_dpo_exports_a_peft_adapter(setup, tmp_path, capsys):
    peft = pytest.importorskip("peft")
    train(setup, tmp_path / "run", {**LORA, "runner_config.stop_step": 3, "preference_config.reference": "adapter"})
    capsys.readouterr()
    assert main(["export", str(tmp_path / "run"), "--output", str(tmp_path / "adapter")]) == 0
    assert "AutoPeftModelForCausalLM" in capsys.readouterr().out
    auto = peft.AutoPeftModelForCausalLM
    check_loads(tmp_path / "run", setup, lambda: auto.from_pretrained(str(tmp_path / "adapter"), dtype=torch.float32))
