"""The DeepSeek family proven against `transformers` (fp32): tiny random DeepSeek-V2-Lite-shaped (no q_lora_rank,
greedy softmax routing), DeepSeek-V2-shaped (group-limited greedy) and DeepSeek-V3-shaped (low-rank queries,
sigmoid routing with a nonzero score-correction bias, group-limited top-k, YaRN with mscale / mscale_all_dim,
interleaved rotary) models built and saved by transformers. Import gives its logits and gradients, export reloads in
transformers with the same logits and the same tensors on disk, and greedy generation through the latent cache gives
transformers' tokens, one prompt and a left-padded batch."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from safetensors.torch import load_file

from conftest import HF_SMALL, imports_with_its_logits, save_hf_model, tokens
from meshformer.cli.main import main
from meshformer.interop.inference import load_for_inference
from meshformer.models.generate import generate, generate_batch

transformers = pytest.importorskip("transformers")

MLA = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, num_key_value_heads=4)
MOE = dict(moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1)
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "mscale": 1.0,
    "mscale_all_dim": 0.707,
    "beta_fast": 32,
    "beta_slow": 1,
}
CASES = {  # name: (transformers class prefix, config overrides)
    "v2_lite": ("DeepseekV2", dict(**MLA, **MOE, q_lora_rank=None, n_shared_experts=2, topk_method="greedy")),
    "v2_group_limited": (
        "DeepseekV2",
        dict(
            **MLA,
            **MOE,
            q_lora_rank=32,
            n_shared_experts=2,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.5,
            rope_scaling={**YARN, "mscale": 0.707, "mscale_all_dim": 0.707},  # DeepSeek-V2's own YaRN settings
        ),
    ),
    "v3_half_split_rotary": (
        "DeepseekV3",
        dict(**MLA, **MOE, q_lora_rank=32, n_group=2, topk_group=1, rope_interleave=False),
    ),
    "v3": (
        "DeepseekV3",
        dict(
            **MLA,
            **MOE,
            num_hidden_layers=3,
            q_lora_rank=32,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            rope_interleave=True,
            rope_scaling=YARN,
        ),
    ),
}


def _random_bias(model) -> None:
    """A nonzero score-correction bias, large enough to change which experts are chosen."""
    g = torch.Generator().manual_seed(1)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(torch.randn(b.shape, generator=g) * 0.3)


def hf_deepseek(case: str, out, tokenizer_dir):
    family, overrides = CASES[case]
    return save_hf_model(out, tokenizer_dir, {**HF_SMALL, **overrides}, family, before_save=_random_bias)


def hf_tensors(d) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_import_export_generate_match_transformers(case, tmp_path, tokenizer_dir, capsys):
    src = tmp_path / "hf"
    reference = hf_deepseek(case, src, tokenizer_dir)
    if case == "v3":  # the bias really is there and really changes the routing
        gate = reference.model.layers[1].mlp.gate
        assert gate.e_score_correction_bias.abs().min() > 0
    x, want, _ = imports_with_its_logits(reference, src, tmp_path / "ckpt", capsys)
    ours, cfg, _ = load_for_inference(tmp_path / "ckpt")
    assert cfg.model.model_config.kv_lora_rank is not None and cfg.model.model_config.is_moe
    if case == "v3":  # the imported bias is what makes the logits equal
        unbiased, _, _ = load_for_inference(tmp_path / "ckpt")
        with torch.no_grad():
            for name, b in unbiased.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.zero_()
            assert (unbiased(x) - want).abs().amax() > 1e-2

    # gradients too: the same loss backpropagated through both
    ours.train()
    reference.train()
    ours(x).logsumexp(-1).mean().backward()
    reference(x).logits.logsumexp(-1).mean().backward()
    theirs = {k.removeprefix("model."): p.grad for k, p in reference.named_parameters()}
    ffn = CASES[case][1]["moe_intermediate_size"]
    theirs["layers.1.mlp.experts.gate_proj"] = theirs["layers.1.mlp.experts.gate_up_proj"][:, :ffn]  # fused there
    for name in (
        "self_attn.kv_a_proj_with_mqa.weight",
        "self_attn.kv_b_proj.weight",
        "mlp.gate.weight",
        "mlp.experts.gate_proj",
        "mlp.shared_experts.up_proj.weight",
    ):
        got = ours.get_parameter(f"layers.1.{name}").grad
        torch.testing.assert_close(got, theirs[f"layers.1.{name}"], rtol=1e-4, atol=1e-6)
    ours.eval()

    assert main(["export", str(tmp_path / "ckpt"), "--output", str(tmp_path / "out")]) == 0
    back, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(x).logits, want, rtol=1e-4, atol=1e-4)
    original, exported = hf_tensors(src), hf_tensors(tmp_path / "out")
    assert sorted(original) == sorted(exported)
    assert all(torch.equal(original[k], exported[k]) for k in original)  # bit for bit, the bias included

    # greedy generation through the latent cache: transformers' tokens, alone and in a left-padded batch
    prompts = [x[0, :9].tolist(), x[1, :5].tolist()]
    eos = reference.generation_config.eos_token_id
    expected = []
    for p in prompts:
        with torch.no_grad():
            full = reference.eval().generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)
        expected.append(full[0, len(p) :].tolist())
    assert max(len(e) for e in expected) > 4  # a real continuation, not an immediate end of sequence
    assert generate(ours, prompts[0], 12, greedy=True, eos_id=eos) == expected[0]
    assert generate_batch(ours, prompts, 12, greedy=True, eos_id=eos) == expected
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(tmp_path / "ckpt"), "--prompt", "to be", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.strip()


def test_router_is_transformers_where_biased_scores_are_negative():
    """DeepSeek-V3's group-limited choice with a bias that makes most biased scores negative: the groups left out
    must never be chosen (transformers masks them with -inf; a 0.0 fill would pick them over negative scores)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from meshformer.config.load import from_dict
    from meshformer.config.schema import ModelConfig
    from meshformer.models.deepseek import hf as deepseek_hf
    from meshformer.models.moe.router import Router

    overrides = {**HF_SMALL, **MLA, **MOE, "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2}
    config = transformers.DeepseekV3Config(**overrides)
    fields = deepseek_hf.config_from_hf(json.loads(config.to_json_string()))
    mc = from_dict(ModelConfig, fields, ("model", "model_config"), [])
    theirs, ours = DeepseekV3TopkRouter(config), Router(mc)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(8, 64, generator=g) * 0.1)
        theirs.e_score_correction_bias.copy_(torch.tensor([0.0, 0.1, -1.5, -1.4, -1.6, -1.3, -1.7, -1.2]))
        ours.weight.copy_(theirs.weight)
        ours.e_score_correction_bias.copy_(theirs.e_score_correction_bias)
    x = torch.randn(64, 64, generator=g)
    _, want_weights, want_idx = theirs(x)
    route = ours(x)
    order_ours, order_theirs = route.indices.argsort(-1), want_idx.argsort(-1)
    assert torch.equal(route.indices.gather(1, order_ours), want_idx.gather(1, order_theirs))
    torch.testing.assert_close(route.weights.gather(1, order_ours), want_weights.gather(1, order_theirs))


def test_latent_decoding_equals_the_expanded_form_and_the_full_forward(tmp_path, tokenizer_dir, monkeypatch):
    """Decoding in the latent space (the absorbed kv_b_proj) computes what expanding every cached latent and what
    one forward over the whole sequence compute; the cache holds kv_lora_rank + qk_rope_head_dim per token."""
    from meshformer.models.deepseek import LatentAttention

    src = tmp_path / "hf"
    hf_deepseek("v3", src, tokenizer_dir)
    assert main(["import", str(src), "--output", str(tmp_path / "ckpt")]) == 0
    model, cfg, _ = load_for_inference(tmp_path / "ckpt")
    mc = cfg.model.model_config
    x = tokens()[:, :16]
    with torch.no_grad():
        whole = model(x)
        step_logits = {}
        for absorb in (True, False):
            monkeypatch.setattr(LatentAttention, "absorb", absorb)
            cache = model.new_kv_cache(2, 16)
            parts = [model(x[:, :6], cache)] + [model(x[:, i : i + 1], cache) for i in range(6, 16)]
            step_logits[absorb] = torch.cat(parts, dim=1)
    assert cache.k[0].shape == (2, 1, 16, mc.kv_lora_rank + mc.qk_rope_head_dim)
    assert not hasattr(cache, "v")
    torch.testing.assert_close(step_logits[True], whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step_logits[False], whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "rope",
    [
        YARN,
        {**YARN, "mscale": None},  # not given: the attention factor is mscale(factor)
        {**YARN, "mscale_all_dim": None, "factor": 40.0, "beta_fast": 16},
        {**YARN, "factor": 1.0},
    ],
)
def test_yarn_tables_and_softmax_scale_are_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, yarn_apply_mscale

    from meshformer.config.load import from_dict
    from meshformer.config.schema import ModelConfig
    from meshformer.models.deepseek import hf as deepseek_hf
    from meshformer.models.deepseek.rope_yarn import attention_factor, inv_freq, softmax_scale

    rope = {k: v for k, v in rope.items() if v is not None}
    config = transformers.DeepseekV3Config(**{**HF_SMALL, **MLA, **MOE, "rope_scaling": rope})
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    fields = deepseek_hf.config_from_hf(json.loads(config.to_json_string()))
    mc = from_dict(ModelConfig, fields, ("model", "model_config"), [])
    torch.testing.assert_close(inv_freq(mc), want_freq, rtol=1e-6, atol=0)
    assert math.isclose(attention_factor(mc), want_factor, rel_tol=1e-12)
    assert math.isclose(softmax_scale(mc), yarn_apply_mscale(config.rope_parameters, 24**-0.5), rel_tol=1e-12)


def test_blocked_attention_with_a_scale_and_narrower_values_is_sdpa():
    from meshformer.backends.cpu_attention import blocked_causal_attention

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 40, 24, generator=g), torch.randn(2, 4, 40, 24, generator=g)
    v = torch.randn(2, 4, 40, 12, generator=g)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    torch.testing.assert_close(blocked_causal_attention(q, k, v, block=16, scale=0.3), want, rtol=1e-5, atol=1e-5)


def test_param_count_and_registry():
    from meshformer.config.load import from_dict
    from meshformer.config.schema import ModelConfig
    from meshformer.models import family_for_hf, family_of
    from meshformer.models.deepseek import hf as deepseek_hf

    for case, (family, overrides) in CASES.items():
        config = getattr(transformers, f"{family}Config")(**{**HF_SMALL, **overrides})
        hf = json.loads(config.to_json_string())
        fam, _ = family_for_hf({**hf, "architectures": [f"{family}ForCausalLM"]}, "config.json")
        assert fam.name == "deepseek" and fam.moe
        mc = from_dict(ModelConfig, deepseek_hf.config_from_hf(hf), ("model", "model_config"), [])
        with torch.device("meta"):
            n = sum(p.numel() for p in getattr(transformers, f"{family}ForCausalLM")(config).parameters())
        assert family_of(mc).param_count(mc) == n, case


def test_unsupported_config_is_one_line_exit_2(tmp_path, tokenizer_dir, capsys):
    src = tmp_path / "hf"
    hf_deepseek("v2_lite", src, tokenizer_dir)
    cfg = json.loads((src / "config.json").read_text())
    for key, value, message in (
        ("attention_bias", True, "attention_bias true is not supported"),
        ("rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}, "rope scaling 'linear'"),
        ("topk_method", "noaux_tc", "DeepSeek-V2 routes greedy or group_limited_greedy"),
    ):
        (src / "config.json").write_text(json.dumps({**cfg, key: value}))
        capsys.readouterr()
        assert main(["import", str(src), "--output", str(tmp_path / f"out_{key}")]) == 2, key
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and re.search(message, err), (key, err)


DEEPSEEK_V3_TINY = {  # the tiny dataset's model width, latent attention and routed experts as DeepSeek-V3 lays them out
    "model.model_config.type": "DeepseekV3Config",
    "model.model_config.n_kv_heads": 4,
    "model.model_config.q_lora_rank": 16,
    "model.model_config.kv_lora_rank": 8,
    "model.model_config.qk_rope_head_dim": 4,
    "model.model_config.qk_nope_head_dim": 8,
    "model.model_config.v_head_dim": 8,
    "model.model_config.rope_interleave": True,
    "model.model_config.moe_config.expert_num": 4,
    "model.model_config.moe_config.num_experts_chosen": 2,
    "model.model_config.moe_config.moe_intermediate_size": 16,
    "model.model_config.moe_config.shared_expert_num": 1,
    "model.model_config.moe_config.use_gating_sigmoid": True,
    "model.model_config.moe_config.topk_method": "noaux_tc",
    "model.model_config.moe_config.n_group": 2,
    "model.model_config.moe_config.topk_group": 1,
    "model.model_config.moe_config.first_k_dense_replace": 1,
}


def test_a_tiny_deepseek_v3_trains_and_its_loss_falls(tiny_dataset, tmp_path):
    from conftest import tiny_overrides
    from meshformer.config import load_config
    from meshformer.train.trainer import run_training

    out = tmp_path / "run"
    cfg = load_config(None, tiny_overrides(tiny_dataset, out, {**DEEPSEEK_V3_TINY, "runner_config.stop_step": 30}))
    run_training(cfg)
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    start, end = sum(r["loss"] for r in recs[:3]) / 3, sum(r["loss"] for r in recs[-3:]) / 3
    assert end < start - 0.5, (start, end)


def test_multi_token_prediction_layers_are_dropped_as_transformers_drops_them(tmp_path, tokenizer_dir, capsys):
    """A checkpoint with DeepSeek-V3's MTP module after the last layer (its eh_proj, norms and a decoder layer's
    tensors) imports as the model without it: transformers' logits."""
    from safetensors.torch import save_file

    src = tmp_path / "hf"
    reference = hf_deepseek("v3", src, tokenizer_dir)
    tensors = hf_tensors(src)
    n = CASES["v3"][1]["num_hidden_layers"]
    mtp = {
        k.replace(f"layers.{n - 1}.", f"layers.{n}."): t.clone() for k, t in tensors.items() if f"layers.{n - 1}." in k
    }
    mtp[f"model.layers.{n}.eh_proj.weight"] = torch.zeros(64, 128)
    mtp[f"model.layers.{n}.enorm.weight"] = torch.ones(64)
    save_file({**tensors, **mtp}, str(src / "model.safetensors"))
    imports_with_its_logits(reference, src, tmp_path / "ckpt", capsys)
