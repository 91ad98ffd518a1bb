"""Mixtral, Qwen2-MoE and Qwen3-MoE import and export, proven against `transformers` (fp32): tiny random models
built and saved (sharded) by transformers itself; import gives its logits within 1e-4, export reloads in
transformers with no missing or unexpected weights, the same logits and the same per-expert tensors on disk bit for
bit (Mixtral's `block_sparse_moe.experts.E.w1`, Qwen2-MoE's gated `shared_expert`), and greedy generation through
meshformer's KV cache gives transformers' tokens. What the Hugging Face architectures cannot express is refused in
one line both ways."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import (
    HF_SMALL,
    exports_as_the_original,
    hf_tensors,
    imports_with_its_logits,
    refused,
    save_hf_model,
    tokens,
)
from meshformer.cli.main import main
from meshformer.config.load import from_dict
from meshformer.config.schema import ModelConfig
from meshformer.errors import UserError
from meshformer.interop.hf_config import hf_config_from_model, model_config_from_hf
from meshformer.interop.inference import load_for_inference
from meshformer.models.generate import generate

transformers = pytest.importorskip("transformers")

MOE = {**HF_SMALL, "num_key_value_heads": 2}
CASES = {  # name: (transformers class prefix, config overrides, expected dense layers)
    "mixtral": ("Mixtral", dict(num_local_experts=4, num_experts_per_tok=2, rope_theta=1e6), []),
    "qwen2_moe_shared_gate": (
        "Qwen2Moe",
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48),
        [],
    ),
    "qwen3_moe_sparse_step2": (
        "Qwen3Moe",
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=32, decoder_sparse_step=2),
        [0],
    ),
    "qwen3_moe_mlp_only_norm": (
        "Qwen3Moe",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1], norm_topk_prob=True),
        [1],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_moe_import_export_generate_match_transformers(case, tmp_path, tokenizer_dir, capsys):
    family, overrides, dense = CASES[case]
    src = tmp_path / "hf"
    reference = save_hf_model(src, tokenizer_dir, {**MOE, **overrides}, family, shard="100KB")
    assert len(list(src.glob("*.safetensors"))) > 1  # sharded, with an index
    x, want, cfg = imports_with_its_logits(reference, src, tmp_path / "ckpt", capsys)
    mc = cfg.model.model_config
    assert mc.is_moe and [i for i in range(mc.num_layers) if not mc.is_moe_layer(i)] == dense

    ours, _, _ = load_for_inference(tmp_path / "ckpt")
    for i in range(mc.num_layers):  # stacked [experts, out, in] from the per-expert tensors on disk
        experts = getattr(ours.layers[str(i)].mlp, "experts", None)
        assert (experts is not None) == (i not in dense)
    prompt = tokens()[0, :6].tolist()
    with torch.no_grad():
        theirs = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
    assert generate(ours, prompt, 12, greedy=True) == theirs[0, len(prompt) :].tolist()

    exports_as_the_original(src, tmp_path / "ckpt", tmp_path / "out", x, want)  # same logits, tensors bit for bit
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    for key, value in overrides.items():
        assert saved[key] == value, key


def test_transformers_in_memory_fused_experts_import_too(tmp_path, tokenizer_dir, capsys):
    """A state_dict saved as transformers 5 holds it in memory (experts.gate_up_proj [E, 2F, D])."""
    src = tmp_path / "hf"
    family, overrides, _ = CASES["qwen3_moe_mlp_only_norm"]
    reference = save_hf_model(src, tokenizer_dir, {**MOE, **overrides}, family)
    state = reference.state_dict()
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    (src / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in state.items()}, str(src / "model.safetensors"))
    imports_with_its_logits(reference, src, tmp_path / "ckpt", capsys)


def hf_config(model_type: str, **extra) -> dict:
    arch = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
    base = {**MOE, "architectures": [arch[model_type]], "model_type": model_type, "num_experts_per_tok": 2}
    base.update(
        {"num_local_experts": 4} if model_type == "mixtral" else {"num_experts": 4, "moe_intermediate_size": 32}
    )
    if model_type == "qwen2_moe":
        base["shared_expert_intermediate_size"] = 48
    return {**base, **extra}


def test_config_json_fields_map_both_ways():
    fields = model_config_from_hf(hf_config("qwen2_moe", norm_topk_prob=True, qkv_bias=False))
    mc = from_dict(ModelConfig, fields, ("model", "model_config"), [])
    m = mc.moe_config
    assert (m.expert_num, m.num_experts_chosen, m.moe_intermediate_size, m.norm_topk_prob) == (4, 2, 32, True)
    assert (mc.shared_ffn_size, m.shared_expert_gate, mc.qkv_has_bias, mc.use_qk_norm) == (48, True, False, False)
    assert m.aux_loss_types == []  # transformers adds its loss only with output_router_logits
    mixtral = model_config_from_hf(hf_config("mixtral", norm_topk_prob=False, intermediate_size=96))
    assert mixtral["moe_config"]["norm_topk_prob"] is True  # Mixtral always renormalises
    assert mixtral["moe_config"]["moe_intermediate_size"] == 96
    qwen3 = model_config_from_hf(hf_config("qwen3_moe", num_local_experts=4, output_router_logits=True))
    assert qwen3["use_qk_norm"] and qwen3["moe_config"]["aux_loss_types"] == ["micro_batch"]
    assert qwen3["moe_config"]["aux_loss_factors"] == [0.001]  # transformers' default coefficient
    assert hf_config_from_model(from_dict(ModelConfig, qwen3, ("model", "model_config"), []), "float32")[
        "output_router_logits"
    ]
    # Qwen3-MoE files spell the expert count num_experts (hub) or num_local_experts (transformers 5)
    del_experts = {k: v for k, v in hf_config("qwen3_moe").items() if k != "num_experts"}
    assert model_config_from_hf({**del_experts, "num_local_experts": 8})["moe_config"]["expert_num"] == 8
    # first_k_dense_replace has a Qwen spelling: those layers join mlp_only_layers
    fields = model_config_from_hf(hf_config("qwen3_moe", num_hidden_layers=4, mlp_only_layers=[3]))
    fields["moe_config"] = {**fields["moe_config"], "mlp_only_layers": [3], "first_k_dense_replace": 2}
    out = hf_config_from_model(from_dict(ModelConfig, fields, ("model", "model_config"), []), "float32")
    assert out["mlp_only_layers"] == [0, 1, 3]


@pytest.mark.parametrize(
    "model_type, extra, needle",
    [
        ("mixtral", {"sliding_window": 64}, "sliding_window=64"),
        ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 64}, "use_sliding_window=true"),
        ("qwen3_moe", {"attention_bias": True}, "attention_bias=true"),
        ("mixtral", {"router_jitter_noise": 0.01}, "router_jitter_noise=0.01"),
        ("mixtral", {"num_experts_per_tok": 1}, "num_experts_per_tok=1"),
        ("qwen3_moe", {"num_experts_per_tok": 5}, "num_experts_per_tok=5 must be between 1 and the 4 experts"),
        ("qwen2_moe", {"num_experts": 1}, "dense model"),
        ("qwen2_moe", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ("qwen3_moe", {"moe_intermediate_size": None}, "moe_intermediate_size missing"),
    ],
)
def test_what_transformers_models_do_that_meshformer_cannot_is_refused(model_type, extra, needle):
    with pytest.raises(UserError, match=needle) as e:
        model_config_from_hf(hf_config(model_type, **extra))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "model_type, moe, needle",
    [
        ("Qwen3MoeConfig", {"use_gating_sigmoid": True}, "use_gating_sigmoid=true"),
        ("Qwen3MoeConfig", {"balance_via_topk_bias": True}, "balance_via_topk_bias=true"),
        ("Qwen3MoeConfig", {"routed_scaling_factor": 2.5}, "routed_scaling_factor=2.5"),
        ("Qwen3MoeConfig", {"shared_expert_num": 1}, "shared experts"),
        ("Qwen2MoeConfig", {}, "no gated shared expert"),
        ("MixtralConfig", {"norm_topk_prob": False}, "norm_topk_prob=false"),
        ("MixtralConfig", {"first_k_dense_replace": 1}, "dense layers"),
    ],
)
def test_export_refuses_what_the_architecture_cannot_express(model_type, moe, needle):
    fields = {"type": model_type, "num_layers": 2, "hidden_size": 64, "num_heads": 4, "intermediate_size": 128}
    fields["use_qk_norm"] = model_type == "Qwen3MoeConfig"
    fields["moe_config"] = {"expert_num": 4, "num_experts_chosen": 2, **moe}
    mc = from_dict(ModelConfig, fields, ("model", "model_config"), [])
    with pytest.raises(UserError, match=needle) as e:
        hf_config_from_model(mc, "float32")
    assert "\n" not in str(e.value)


def test_a_refused_moe_directory_is_one_line_exit_2(tmp_path, tokenizer_dir, capsys):
    src = tmp_path / "hf"
    save_hf_model(src, tokenizer_dir, {**MOE, **CASES["mixtral"][1], "sliding_window": 64}, "Mixtral")
    capsys.readouterr()
    refused(capsys, main(["import", str(src), "--output", str(tmp_path / "ckpt")]), "sliding_window=64")
    assert not list(tmp_path.glob("ckpt*"))


def test_ckpt_merge_names_moe_optimizer_state_after_the_weights_on_disk(tmp_path, tiny_dataset):
    from conftest import tiny_overrides
    from meshformer.config import load_config
    from meshformer.train.trainer import run_training

    moe = "model.model_config.moe_config."
    extra = {
        "model.model_config.type": "Qwen2MoeConfig",
        f"{moe}expert_num": 4,
        f"{moe}num_experts_chosen": 2,
        f"{moe}moe_intermediate_size": 32,
        f"{moe}shared_expert_intermediate_size": 32,
        f"{moe}shared_expert_gate": "true",
        "runner_config.stop_step": 2,
    }
    run_training(load_config(None, tiny_overrides(tiny_dataset, tmp_path / "run", extra)))
    assert main(["ckpt", "merge", str(tmp_path / "run"), "--output", str(tmp_path / "merged"), "--optimizer"]) == 0
    weights = hf_tensors(tmp_path / "merged")
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in weights and any(".shared_expert." in k for k in weights)
    optim = load_file(tmp_path / "merged" / "optimizer.safetensors")
    for stat in ("exp_avg", "exp_avg_sq"):  # AdamW's moments, per expert like the weights
        named = {k.removeprefix("state.").removesuffix(f".{stat}"): v for k, v in optim.items() if k.endswith(stat)}
        assert set(named) == set(weights)
        assert all(named[k].shape == weights[k].shape for k in weights)
    back, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "merged", dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info


# The MoE keys of hub config.json files as they are published (other keys trimmed): hub spellings, not
# transformers 5's (Qwen3-MoE's num_experts, Qwen1.5-MoE without qkv_bias, sliding_window set but off).
HUB = {
    "Qwen/Qwen3-30B-A3B": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        **{"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32},
        **{"num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960},
        **{"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True},
        **{"decoder_sparse_step": 1, "mlp_only_layers": [], "rope_theta": 1000000.0, "rope_scaling": None},
        **{"sliding_window": None, "use_sliding_window": False, "attention_bias": False, "output_router_logits": False},
    },
    "Qwen/Qwen1.5-MoE-A2.7B": {
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        **{"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24, "num_attention_heads": 16},
        **{"num_key_value_heads": 16, "vocab_size": 151936, "max_position_embeddings": 8192},
        **{"num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408, "norm_topk_prob": False},
        **{"shared_expert_intermediate_size": 5632, "decoder_sparse_step": 1, "rope_theta": 1000000.0},
        **{"sliding_window": 32768, "use_sliding_window": False, "output_router_logits": False},
    },
    "mistralai/Mixtral-8x7B-v0.1": {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        **{"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32},
        **{"num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 32768, "rope_theta": 1e6},
        **{"num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02, "sliding_window": None},
        **{"output_router_logits": False, "router_jitter_noise": 0.0},
    },
}


@pytest.mark.parametrize("hub", list(HUB))
def test_hub_config_json_files_import_and_export_their_moe_keys(hub):
    hf = HUB[hub]
    mc = from_dict(ModelConfig, model_config_from_hf(hf, hub), ("model", "model_config"), [])
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    assert (mc.moe_config.expert_num, mc.moe_config.num_experts_chosen) == (experts, hf["num_experts_per_tok"])
    assert mc.expert_ffn_size == hf.get("moe_intermediate_size", hf["intermediate_size"])
    assert mc.qkv_has_bias == (hf["model_type"] == "qwen2_moe") and all(
        mc.is_moe_layer(i) for i in range(mc.num_layers)
    )
    back = hf_config_from_model(mc, "bfloat16")
    for key in ("num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob"):
        if key in hf:
            assert back[key] == hf[key], key
    assert back.get("num_experts", back.get("num_local_experts")) == experts
