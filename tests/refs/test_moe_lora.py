"""LoRA fine-tuning of imported MoE models, proven against `peft` and `transformers`: a tiny random Qwen3-MoE (one
dense layer) is imported, fine-tuned with `run_mode: finetune` (the MoE shape comes from the checkpoint) with
adapters on attention, and the exported adapter loads in `peft.AutoPeftModelForCausalLM` onto transformers' model
with meshformer's logits (fp32, 1e-4). Adapters on a dense MLP and Qwen2-MoE's shared expert train too; peft reads an
MoE adapter's MLP targets as its routed experts, so that adapter's PEFT export is refused in one line and
`--merge-lora` writes the full model, which transformers loads with the same logits. Routed experts are stacked
parameters: never adapted, and a target naming only them (or the routers) is refused."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import TINY_HF_LLAMA, refused, save_hf_model, tiny_overrides, tokens
from meshformer.cli.main import main
from meshformer.config import load_config
from meshformer.errors import UserError
from meshformer.interop.inference import load_for_inference
from meshformer.train.trainer import run_training

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

ATTENTION = "[q_proj, k_proj, v_proj, o_proj]"
LORA = {
    "run_mode": "finetune",
    "model.model_config.pet_config.pet_type": "lora",
    "model.model_config.pet_config.lora_rank": 8,
    "model.model_config.pet_config.lora_alpha": 16,
    "model.model_config.pet_config.target_modules": ATTENTION,
    "model.model_config.rms_norm_eps": 1e-5,
    "optimizer.learning_rate": 5e-2,
    "runner_config.stop_step": 8,
}
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def fine_tune(tmp_path, tiny_dataset, tokenizer_dir, family: str, overrides: dict, targets: str):
    """Import a transformers model, LoRA-fine-tune it 8 steps; returns (transformers' model, the run's losses)."""
    src = tmp_path / "hf"
    base = save_hf_model(src, tokenizer_dir, {**TINY_HF_LLAMA, **overrides}, family)
    assert main(["import", str(src), "--output", str(tmp_path / "ckpt")]) == 0
    extra = {**LORA, "load_checkpoint": str(tmp_path / "ckpt"), "model.model_config.pet_config.target_modules": targets}
    run_training(load_config(None, tiny_overrides(tiny_dataset, tmp_path / "run", extra)))
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 8 and sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.05, losses
    return base


def test_moe_attention_lora_exports_an_adapter_peft_loads(tmp_path, tiny_dataset, tokenizer_dir, capsys):
    overrides = dict(MOE, mlp_only_layers=[0], norm_topk_prob=True)
    base = fine_tune(tmp_path, tiny_dataset, tokenizer_dir, "Qwen3Moe", overrides, ATTENTION)
    capsys.readouterr()
    assert main(["export", str(tmp_path / "run"), "--output", str(tmp_path / "adapter")]) == 0
    adapter = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str((tmp_path / "hf").absolute())
    assert adapter["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]

    ours, cfg, _ = load_for_inference(tmp_path / "run")
    assert cfg.model.model_config.is_moe and cfg.model.model_config.moe_config.norm_topk_prob
    x = tokens()
    with torch.no_grad():
        want = ours(x)
        assert (want - base(x).logits).abs().max() > 1e-3  # the adapters learned something
        loaded = peft.AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "adapter"), dtype=torch.float32)
        wrapped = {n for n, m in loaded.named_modules() if n.endswith("_proj") and hasattr(m, "lora_A")}
        assert len(wrapped) == 4 * 2, wrapped  # PEFT adapts the same linears, no more
        torch.testing.assert_close(loaded.eval()(x).logits, want, rtol=1e-4, atol=1e-4)

    # run_mode: finetune took the MoE shape from the checkpoint; a given one that differs is one line
    other = {**LORA, "load_checkpoint": str(tmp_path / "ckpt"), "model.model_config.type": "Qwen3MoeConfig"}
    other["model.model_config.moe_config.expert_num"] = 8
    with pytest.raises(UserError, match="moe_config.expert_num=8 but the model in load_checkpoint has 4"):
        run_training(load_config(None, tiny_overrides(tiny_dataset, tmp_path / "run2", other)))


def test_moe_mlp_lora_trains_and_merges_into_the_shared_expert(tmp_path, tiny_dataset, tokenizer_dir, capsys):
    targets = "[q_proj, v_proj, gate_proj, up_proj, down_proj]"
    overrides = dict(MOE, shared_expert_intermediate_size=48, decoder_sparse_step=2)  # layer 0 dense
    base = fine_tune(tmp_path, tiny_dataset, tokenizer_dir, "Qwen2Moe", overrides, targets)
    ours, _, _ = load_for_inference(tmp_path / "run")
    adapted = {n.removesuffix(".lora_A") for n, _ in ours.named_modules() if n.endswith(".lora_A")}
    assert {"layers.0.mlp.gate_proj", "layers.1.mlp.shared_experts.down_proj"} <= adapted
    assert not any(".experts." in n for n in adapted)  # routed experts are stacked: never adapted

    capsys.readouterr()
    err = refused(
        capsys, main(["export", str(tmp_path / "run"), "--output", str(tmp_path / "adapter")]), "--merge-lora"
    )
    assert "routed experts" in err and not (tmp_path / "adapter").exists()
    assert main(["export", str(tmp_path / "run"), "--output", str(tmp_path / "merged"), "--merge-lora"]) == 0
    back, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "merged", dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info
    x = tokens()
    with torch.no_grad():
        want = ours(x)
        assert (want - base(x).logits).abs().max() > 1e-3
        torch.testing.assert_close(back.eval()(x).logits, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("targets", ["[gate]", ".*experts.*", "[w1, w3]"])
def test_targets_naming_only_routed_experts_or_routers_are_refused(targets):
    from meshformer.models import build_model
    from meshformer.models.lora import apply_lora

    over = [
        "--model.model_config.type=MixtralConfig",
        "--model.model_config.num_layers=2",
        "--model.model_config.hidden_size=32",
        "--model.model_config.num_heads=4",
        "--model.model_config.moe_config.expert_num=4",
        "--model.model_config.moe_config.num_experts_chosen=2",
        "--model.model_config.pet_config.pet_type=lora",
        f"--model.model_config.pet_config.target_modules={targets}",
    ]
    cfg = load_config(None, over)
    with pytest.raises(UserError, match="matches only routed experts or routers") as e:
        apply_lora(build_model(cfg.model.model_config), cfg)
    assert "\n" not in str(e.value)
