"""The Mistral family (models/mistral/): a tiny random transformers MistralForCausalLM whose
sliding window (8) is shorter than the text (40 tokens, five windows) imports with transformers' logits (fp32,
1e-5), exports back bit for bit and reloads in transformers, passes `--verify`, and decodes greedily past the window
through the rolling KV cache with transformers' tokens; Mistral with `sliding_window: null` is the same family with
global attention. A LoRA fine-tune exports a PEFT adapter peft loads with the same logits; packed rows with the
window equal each sample alone; FLOPs and the KV cache count the window; the planner is exact on CPU; bad windows
are one line, exit 2."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import EMPTY, HF_SMALL, checksums, exports_as_the_original, fails, save_hf_model
from family_checks import (
    assert_packed_rows_equal_each_sample_alone,
    assert_peft_gives_our_logits,
    assert_plan_matches_a_training_step,
    assert_rel,
    lora_fine_tune_and_export,
    text,
)
from meshformer.cli.main import main
from meshformer.config import load_config
from meshformer.errors import UserError
from meshformer.interop.inference import load_for_inference
from meshformer.models import create_model
from meshformer.models.generate import generate
from meshformer.models.registry import family_for_hf, family_of, model_config

transformers = pytest.importorskip("transformers")

WINDOW = 8
MISTRAL = {**HF_SMALL, "num_key_value_heads": 2, "rope_theta": 1e5, "sliding_window": WINDOW}


@pytest.fixture
def imported(tmp_path, tokenizer_dir, capsys):
    """(transformers' model, its directory, our checkpoint) of a windowed Mistral, imported with --verify."""
    src = tmp_path / "mistral"
    reference = save_hf_model(src, tokenizer_dir, MISTRAL, "Mistral", shard="150KB")
    assert main(["import", str(src), "--output", str(tmp_path / "ckpt"), "--verify"]) == 0
    assert "max |logit difference|" in capsys.readouterr().out
    return reference, src, tmp_path / "ckpt"


def test_windowed_mistral_imports_with_transformers_logits_and_exports_bit_for_bit(imported, tmp_path):
    reference, src, ckpt = imported
    ours, cfg, _ = load_for_inference(ckpt)
    mc = cfg.model.model_config
    assert (mc.type, mc.sliding_window) == ("MistralConfig", WINDOW)
    assert [layer.self_attn.window for layer in ours.layers.values()] == [WINDOW, WINDOW]
    x = text()
    with torch.no_grad():
        want = reference(x).logits
        got = ours(x)
        for layer in ours.layers.values():  # the window decides these logits
            layer.self_attn.window = None
        assert (ours(x) - want).abs().max() > 1e-2
    assert_rel(got, want)
    back = exports_as_the_original(src, ckpt, tmp_path / "out", x, want)
    assert back.config.sliding_window == WINDOW
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["architectures"] == ["MistralForCausalLM"] and exported["sliding_window"] == WINDOW


def test_greedy_generation_past_the_window_gives_transformers_tokens(imported):
    reference, _, ckpt = imported
    ours, _, _ = load_for_inference(ckpt)
    prompt = [5, 17, 42, 3, 99, 7, 61, 8, 250, 31, 4]  # longer than the window already
    with torch.no_grad():
        want = reference.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, pad_token_id=0)
    cache = ours.new_kv_cache(1, len(prompt) + 20)
    assert [t.shape[2] for t in cache.k] == [WINDOW, WINDOW]  # rolling: the window's keys only
    assert generate(ours, prompt, 20, greedy=True) == want[0, len(prompt) :].tolist()


def test_mistral_without_a_window_is_the_same_family_with_global_attention(tmp_path, tokenizer_dir, capsys):
    src = tmp_path / "mistral"
    reference = save_hf_model(src, tokenizer_dir, {**MISTRAL, "sliding_window": None}, "Mistral")
    assert main(["import", str(src), "--output", str(tmp_path / "ckpt"), "--verify"]) == 0
    ours, cfg, _ = load_for_inference(tmp_path / "ckpt")
    assert (cfg.model.model_config.type, cfg.model.model_config.sliding_window) == ("MistralConfig", None)
    assert all(layer.self_attn.window is None for layer in ours.layers.values())
    x = text()
    with torch.no_grad():
        want = reference(x).logits
        assert_rel(ours(x), want)
    exports_as_the_original(src, tmp_path / "ckpt", tmp_path / "out", x, want)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["sliding_window"] is None
    assert family_for_hf({"architectures": ["MistralForCausalLM"]}, "c.json")[0].name == "mistral"


def test_bad_windows_are_one_line(tmp_path, tokenizer_dir, capsys):
    for bad in (0, -4):
        fails(capsys, ["config", "check", EMPTY, "--model.model_config.type", "MistralConfig",
                       "--model.model_config.sliding_window", str(bad)], "sliding_window")  # fmt: skip
    # larger than seq_length is fine: global attention in effect
    cfg = load_config(
        None, ["--model.model_config.type", "MistralConfig", "--model.model_config.sliding_window", "9999"]
    )
    assert cfg.model.model_config.sliding_window == 9999
    src = tmp_path / "bad"
    save_hf_model(src, tokenizer_dir, MISTRAL, "Mistral")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "sliding_window": 0}))
    before = checksums(tmp_path)
    capsys.readouterr()
    assert main(["import", str(src), "--output", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "sliding_window=0" in err and "Traceback" not in err, err
    assert checksums(tmp_path) == before
    with pytest.raises(UserError, match="qkv_has_bias"):
        family_of(model_config(type="MistralConfig")).config_to_hf(
            model_config(type="MistralConfig", qkv_has_bias=True), "float32"
        )


def test_flops_and_kv_cache_count_the_window():
    shape = dict(hidden_size=64, num_layers=2, num_heads=4, n_kv_heads=2, vocab_size=512, intermediate_size=96)
    windowed = model_config(type="MistralConfig", seq_length=32, sliding_window=WINDOW, **shape)
    glob = model_config(type="MistralConfig", seq_length=32, **shape)
    llama = model_config(type="LlamaConfig", seq_length=32, **shape)
    family = family_of(windowed)
    assert family.flops_per_token(glob) == family_of(llama).flops_per_token(llama)  # no window: Llama's count
    dense = family.attention_cost(glob).flops_per_token
    keys = sum(min(i + 1, WINDOW) for i in range(32))
    assert family.attention_cost(windowed).flops_per_token == dense * keys // (32 * 33 // 2)
    big = model_config(type="MistralConfig", seq_length=32, sliding_window=64, **shape)
    assert family.attention_cost(big).flops_per_token == dense
    assert family.kv_cache_tokens(windowed, 100) == 2 * WINDOW and family.kv_cache_tokens(glob, 100) == 200
    model = create_model(windowed, 0)
    cache = model.new_kv_cache(1, 100)
    assert sum(t.shape[2] for t in cache.k) == family.kv_cache_tokens(windowed, 100)


@torch.no_grad()
def test_packed_rows_with_the_window_equal_each_sample_alone():
    mc = model_config(
        type="MistralConfig", hidden_size=64, num_layers=2, num_heads=4, n_kv_heads=2, vocab_size=512,
        intermediate_size=96, seq_length=40, sliding_window=WINDOW,
    )  # fmt: skip
    model = create_model(mc, 0).eval()
    x = text(40)
    assert_packed_rows_equal_each_sample_alone(model, x)


def test_lora_fine_tune_exports_an_adapter_peft_loads_with_the_same_logits(tmp_path, tiny_dataset, tokenizer_dir):
    pytest.importorskip("peft")
    from conftest import TINY_HF_LLAMA

    src = tmp_path / "hf"
    save_hf_model(src, tokenizer_dir, {**TINY_HF_LLAMA, "sliding_window": WINDOW}, "Mistral")
    assert main(["import", str(src), "--output", str(tmp_path / "ckpt")]) == 0
    run, adapter = lora_fine_tune_and_export(tmp_path / "ckpt", tiny_dataset, tmp_path)
    x = text(32)
    cfg, want, loaded = assert_peft_gives_our_logits(run, adapter, x)
    assert cfg.model.model_config.sliding_window == WINDOW  # the fine-tune took the base's window
    assert loaded.base_model.model.config.sliding_window == WINDOW


def test_the_planner_is_exact_for_the_windowed_family(tiny_dataset, tmp_path):
    """One real training step's measured bytes by component (train/memory.py) against the plan (test_memory.py's
    check), with a window shorter than the row: activations counted on the real modules, within 1e-3."""
    extra = {
        "model.model_config.type": "MistralConfig",
        "model.model_config.sliding_window": WINDOW,
    }
    assert_plan_matches_a_training_step(tiny_dataset, tmp_path, extra)
