"""The GPT-OSS family (models/gpt_oss/, issue 33 item 4): a tiny random transformers GptOssForCausalLM (4 experts,
top-2, layers alternating a sliding window of 8 and full attention, YaRN rotary, learned sinks, biased attention,
router and experts with the clamped SwiGLU) imports with transformers' logits (fp32, 1e-5 relative) under
`--verify`, exports back bit for bit and reloads in transformers, and decodes greedily past the window through the
rolling KV cache with transformers' tokens. A LoRA fine-tune exports a PEFT adapter peft loads with the same logits;
packed rows equal each sample alone; FLOPs and the KV cache count the windows per layer; the planner is exact on CPU;
bad fields (a window of 0 or less, a sink tensor of the wrong shape, an MXFP4 checkpoint) are one line, exit 2."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import (
    EMPTY,
    HF_SMALL,
    TINY_HF_LLAMA,
    checksums,
    exports_as_the_original,
    fails,
    save_hf_model,
)
from family_checks import (
    assert_packed_rows_equal_each_sample_alone,
    assert_peft_gives_our_logits,
    assert_plan_matches_a_training_step,
    assert_rel,
    lora_fine_tune_and_export,
    text,
)
from meshformer.cli.main import main
from meshformer.interop.inference import load_for_inference
from meshformer.models import create_model
from meshformer.models.generate import generate
from meshformer.models.registry import family_for_hf, family_of, model_config

transformers = pytest.importorskip("transformers")

WINDOW = 8
GPT_OSS = {
    **HF_SMALL,
    "intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": WINDOW,
    "max_position_embeddings": 256,
    # YaRN as gpt-oss ships it, on a short original context so that the ramp is inside head_dim
    "rope_parameters": {
        "rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 64, "rope_theta": 150000.0,
    },
}  # fmt: skip


def _spread(model) -> None:
    """Sinks and biases large enough to matter (transformers initialises biases to zero)."""
    for name, p in model.named_parameters():
        if name.endswith("sinks") or "bias" in name:
            p.copy_(torch.randn_like(p))


@pytest.fixture
def imported(tmp_path, tokenizer_dir, capsys):
    """(transformers' model, its directory, our checkpoint) of a tiny GPT-OSS, imported with --verify."""
    src = tmp_path / "gpt_oss"
    reference = save_hf_model(src, tokenizer_dir, GPT_OSS, "GptOss", shard="150KB", before_save=_spread)
    assert main(["import", str(src), "--output", str(tmp_path / "ckpt"), "--verify"]) == 0
    assert "max |logit difference|" in capsys.readouterr().out
    return reference, src, tmp_path / "ckpt"


def test_gpt_oss_imports_with_transformers_logits_and_exports_bit_for_bit(imported, tmp_path):
    reference, src, ckpt = imported
    ours, cfg, _ = load_for_inference(ckpt)
    mc = cfg.model.model_config
    assert (mc.type, mc.sliding_window, mc.rope_scaling.type, mc.rope_scaling.yarn_truncate) == (
        "GptOssConfig", WINDOW, "yarn", False,
    )  # fmt: skip
    assert [layer.self_attn.window for layer in ours.layers.values()] == [WINDOW, None, WINDOW, None]
    x = text()
    with torch.no_grad():
        want = reference(x).logits
        got = ours(x)
        assert_rel(got, want)
        for part in ("window", "sinks"):  # each decides these logits
            layer = ours.layers["0"].self_attn
            kept = getattr(layer, part)
            if part == "window":
                layer.window = None
            else:
                layer.sinks = None
            assert (ours(x) - want).abs().max() > 1e-3, part
            setattr(layer, part, kept)
    back = exports_as_the_original(src, ckpt, tmp_path / "out", x, want)
    assert back.config.layer_types == reference.config.layer_types
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["architectures"] == ["GptOssForCausalLM"] and exported["rope_parameters"]["truncate"] is False
    assert family_for_hf({"architectures": ["GptOssForCausalLM"]}, "c.json")[0].name == "gpt_oss"


def test_greedy_generation_past_the_window_gives_transformers_tokens(imported):
    reference, _, ckpt = imported
    ours, _, _ = load_for_inference(ckpt)
    prompt = [5, 17, 42, 3, 99, 7, 61, 8, 250, 31, 4]  # longer than the window already
    with torch.no_grad():
        want = reference.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, pad_token_id=0)
    cache = ours.new_kv_cache(1, len(prompt) + 20)
    assert [t.shape[2] for t in cache.k] == [WINDOW, 31, WINDOW, 31]  # rolling on the sliding layers only
    assert generate(ours, prompt, 20, greedy=True) == want[0, len(prompt) :].tolist()


def test_bad_fields_are_one_line(tmp_path, tokenizer_dir, capsys):
    for bad in (0, -4):
        fails(capsys, ["config", "check", EMPTY, "--model.model_config.type", "GptOssConfig",
                       "--model.model_config.sliding_window", str(bad)], "sliding_window")  # fmt: skip
    M = "--model.model_config."
    fails(capsys, ["config", "check", EMPTY, M + "type", "GptOssConfig", M + "num_layers", "2",
                   M + "layer_types", "[full_attention]"], "layer_types")  # fmt: skip
    src = tmp_path / "bad"
    save_hf_model(src, tokenizer_dir, {**GPT_OSS, "num_hidden_layers": 2}, "GptOss")
    config = json.loads((src / "config.json").read_text())
    for change, needle in (
        ({"sliding_window": 0}, "sliding_window=0"),
        ({"quantization_config": {"quant_method": "mxfp4"}}, "mxfp4"),
    ):
        (src / "config.json").write_text(json.dumps({**config, **change}))
        before = checksums(tmp_path)
        capsys.readouterr()
        assert main(["import", str(src), "--output", str(tmp_path / "ckpt")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and needle in err and "Traceback" not in err, err
        assert checksums(tmp_path) == before
    (src / "config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file, save_file

    weights = load_file(src / "model.safetensors")
    weights["model.layers.1.self_attn.sinks"] = torch.zeros(2, 2)  # as many numbers, the wrong shape
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    assert main(["import", str(src), "--output", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "sinks" in err and "Traceback" not in err, err


def small(**extra):
    from meshformer.models.gpt_oss.config import GptOssMoeConfig

    fields = dict(hidden_size=64, num_layers=4, num_heads=4, n_kv_heads=2, vocab_size=512, intermediate_size=32)
    fields |= dict(seq_length=32, sliding_window=WINDOW, moe_config=GptOssMoeConfig(expert_num=4, num_experts_chosen=2))
    return model_config(type="GptOssConfig", **{**fields, **extra})


def test_flops_and_kv_cache_count_the_window_per_layer():
    windowed, glob = small(), small(sliding_window=None)
    family = family_of(windowed)
    dense = family.attention_cost(glob).flops_per_token
    keys = sum(min(i + 1, WINDOW) for i in range(32))
    want = 2 * (dense // 4) * keys // (32 * 33 // 2) + 2 * (dense // 4)  # two sliding layers, two full
    assert family.attention_cost(windowed).flops_per_token == want
    assert family.kv_cache_tokens(windowed, 100) == 2 * WINDOW + 2 * 100 and family.kv_cache_tokens(glob, 100) == 400
    model = create_model(windowed, 0)
    cache = model.new_kv_cache(1, 100)
    assert sum(t.shape[2] for t in cache.k) == family.kv_cache_tokens(windowed, 100)
    # active experts: 2 of 4 experts' parameters a token
    from meshformer.models.moe.params import moe_params

    counts = moe_params(family, windowed)
    assert counts.active(2, 4) == counts.total - counts.routed // 2


@torch.no_grad()
def test_packed_rows_equal_each_sample_alone():
    model = create_model(small(seq_length=40), 0).eval()
    for name, p in model.named_parameters():
        if name.endswith("sinks"):
            p.normal_()
    x = text(40)
    assert_packed_rows_equal_each_sample_alone(model, x)


def test_gguf_export_is_refused_in_one_line(imported, tmp_path, capsys):
    """GGUF cannot say YaRN's truncate: false and llama.cpp's rope always truncates (models/gpt_oss/hf.py): refused."""
    _, _, ckpt = imported
    capsys.readouterr()
    assert main(["export", str(ckpt), "--output", str(tmp_path / "m.gguf"), "--format", "gguf"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "GptOssForCausalLM" in err and "Traceback" not in err, err


# The tiny dataset's shape (tiny_overrides) as a GPT-OSS
TINY_GPT_OSS = {**GPT_OSS, **{k: TINY_HF_LLAMA[k] for k in ("hidden_size", "max_position_embeddings", "rms_norm_eps")}}
TINY_GPT_OSS.update(num_hidden_layers=2, intermediate_size=TINY_HF_LLAMA["intermediate_size"], head_dim=8)


def test_lora_fine_tune_exports_an_adapter_peft_loads_with_the_same_logits(tmp_path, tiny_dataset, tokenizer_dir):
    pytest.importorskip("peft")
    src = tmp_path / "hf"
    save_hf_model(src, tokenizer_dir, TINY_GPT_OSS, "GptOss", before_save=_spread)
    assert main(["import", str(src), "--output", str(tmp_path / "ckpt")]) == 0
    run, adapter = lora_fine_tune_and_export(
        tmp_path / "ckpt",
        tiny_dataset,
        tmp_path,
        {"model.model_config.pet_config.target_modules": "[q_proj, k_proj, v_proj, o_proj]"},
    )
    x = text(32)
    cfg, want, loaded = assert_peft_gives_our_logits(run, adapter, x)
    assert cfg.model.model_config.sliding_window == WINDOW  # the fine-tune took the base's shape
    with torch.no_grad():
        base = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
        assert (base.eval()(x).logits - want).abs().max() > 1e-4  # the adapter changed the model


def test_the_planner_is_exact_for_the_family(tiny_dataset, tmp_path):
    """One real training step's measured bytes by component (train/memory.py) against the plan (test_memory.py's
    check): activations counted on the real modules (banded masks, the sinks' key, the experts' closed form)."""
    M = "model.model_config."
    extra = {M + "type": "GptOssConfig", M + "sliding_window": WINDOW}
    extra |= {M + "moe_config.expert_num": 4, M + "moe_config.num_experts_chosen": 2, M + "intermediate_size": 32}
    assert_plan_matches_a_training_step(tiny_dataset, tmp_path, extra, within=None)
