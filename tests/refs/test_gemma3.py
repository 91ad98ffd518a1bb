"""The Gemma 3 family (models/gemma3/, issue 33 item 4): a tiny random transformers Gemma3ForCausalLM (text model,
Gemma3TextConfig) with sliding and global layers in turn, a sliding window (8) shorter than the text (40 tokens),
each kind with its own rotary base (the global one linearly scaled), imports with transformers' logits (fp32, 1e-5),
exports back bit for bit and reloads in transformers, passes `--verify`, and decodes greedily past the window through
the KV cache (rolling on sliding layers, full on global ones) with transformers' tokens. A LoRA fine-tune exports a
PEFT adapter peft loads with the same logits; packed rows equal each sample alone; FLOPs and the KV cache count each
layer's window; the planner is exact on CPU; bad fields are one line, exit 2."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import EMPTY, HF_SMALL, TINY_HF_LLAMA, checksums, exports_as_the_original, fails
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
from meshformer.interop.inference import load_for_inference
from meshformer.models import create_model, num_params
from meshformer.models.generate import generate
from meshformer.models.registry import family_for_hf, family_of, model_config

transformers = pytest.importorskip("transformers")

WINDOW = 8
# 4 layers, sliding and global in turn (pattern 2); a linear factor on the global layers' positions
GEMMA3 = {
    **HF_SMALL, "num_hidden_layers": 4, "num_key_value_heads": 2, "head_dim": 16, "sliding_window": WINDOW,
    "sliding_window_pattern": 2, "query_pre_attn_scalar": 24, "rope_theta": 1e5, "rope_local_base_freq": 1e3,
    "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "tie_word_embeddings": True,
}  # fmt: skip
KINDS = ["sliding_attention", "full_attention"] * 2


def save_gemma3(out, tokenizer_dir, config: dict, shard: str | None = None):
    """conftest.save_hf_model for Gemma3ForCausalLM, whose config class is Gemma3TextConfig: seed 0, weights spread
    by 0.05 N(0, 1) beyond transformers' init (its norms start at zero, the identity)."""
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**config)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(out, **({"max_shard_size": shard} if shard else {}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    return model


@pytest.fixture
def imported(tmp_path, tokenizer_dir, capsys):
    """(transformers' model, its directory, our checkpoint) of a Gemma 3, imported with --verify."""
    src = tmp_path / "gemma3"
    src.mkdir()
    reference = save_gemma3(src, tokenizer_dir, GEMMA3, shard="150KB")
    assert main(["import", str(src), "--output", str(tmp_path / "ckpt"), "--verify"]) == 0
    assert "max |logit difference|" in capsys.readouterr().out
    return reference, src, tmp_path / "ckpt"


def test_gemma3_imports_with_transformers_logits_and_exports_bit_for_bit(imported, tmp_path):
    reference, src, ckpt = imported
    ours, cfg, _ = load_for_inference(ckpt)
    mc = cfg.model.model_config
    assert (mc.type, mc.sliding_window, mc.layer_kinds()) == ("Gemma3Config", WINDOW, KINDS)
    assert mc.global_rope_scaling_factor == 2.0
    assert (mc.theta, mc.rope_local_base_freq, mc.query_pre_attn_scalar) == (1e5, 1e3, 24)
    assert [layer.self_attn.window for layer in ours.layers.values()] == [WINDOW, None, WINDOW, None]
    x = text()
    with torch.no_grad():
        want = reference(x).logits
        got = ours(x)
        for layer in ours.layers.values():  # the window decides these logits
            layer.self_attn.window = None
        assert (ours(x) - want).abs().max() > 1e-2
    assert_rel(got, want)
    back = exports_as_the_original(src, ckpt, tmp_path / "out", x, want)
    assert back.config.layer_types == KINDS and back.config.sliding_window == WINDOW
    assert back.config.rope_parameters["full_attention"] == {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e5}
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["architectures"] == ["Gemma3ForCausalLM"] and exported["model_type"] == "gemma3_text"
    assert family_for_hf({"model_type": "gemma3_text"}, "c.json")[0].name == "gemma3"


def test_greedy_generation_past_the_window_gives_transformers_tokens(imported):
    reference, _, ckpt = imported
    ours, _, _ = load_for_inference(ckpt)
    prompt = [5, 17, 42, 3, 99, 7, 61, 8, 250, 31, 4]  # longer than the window already
    with torch.no_grad():
        want = reference.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, pad_token_id=0)
    cache = ours.new_kv_cache(1, len(prompt) + 20)
    assert [t.shape[2] for t in cache.k] == [WINDOW, 31, WINDOW, 31]  # rolling on sliding layers, full on global
    assert generate(ours, prompt, 20, greedy=True) == want[0, len(prompt) :].tolist()


def test_each_kind_of_layer_has_its_own_rotary_base():
    """Swapping the two bases (or dropping the global layers' linear factor) changes the logits: both take part."""
    mc = gemma3_config(seq_length=40, global_rope_scaling_factor=2.0)
    x = text()
    with torch.no_grad():
        want = create_model(mc, 0)(x)
        for change in ({"theta": 1e3, "rope_local_base_freq": 1e5}, {"global_rope_scaling_factor": 1.0}):
            other = model_config(**{**vars(mc), **change})
            assert (create_model(other, 0)(x) - want).abs().max() > 1e-4, change


def test_embeddings_are_scaled_in_the_weights_dtype_as_transformers_does():
    """sqrt(60) is no bfloat16 number: the factor is rounded to the weight's dtype before the product, bit for bit
    transformers' Gemma3TextScaledWordEmbedding in float32 and bfloat16."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    from meshformer.models.gemma3.model import ScaledEmbedding

    for dtype in (torch.float32, torch.bfloat16):
        theirs = Gemma3TextScaledWordEmbedding(50, 60, 0, embed_scale=60**0.5).to(dtype)
        ours = ScaledEmbedding(50, 60).to(dtype)
        with torch.no_grad():
            ours.weight.copy_(torch.randn(50, 60))
            theirs.weight.copy_(ours.weight)
        ids = torch.arange(50)
        assert torch.equal(ours(ids), theirs(ids)), dtype
        assert not torch.equal(ours(ids), ours.weight * 60**0.5) or dtype == torch.float32


def gemma3_config(**kw):
    shape = dict(
        hidden_size=64, num_layers=4, num_heads=4, n_kv_heads=2, head_dim=16, vocab_size=512, intermediate_size=96,
        sliding_window=WINDOW, sliding_window_pattern=2, query_pre_attn_scalar=16, rope_local_base_freq=1e3,
    )  # fmt: skip
    return model_config(type="Gemma3Config", **{**shape, **kw})


def test_bad_fields_are_one_line(tmp_path, tokenizer_dir, capsys):
    base = ["config", "check", EMPTY, "--model.model_config.type", "Gemma3Config"]
    for bad in (0, -4):
        fails(capsys, [*base, "--model.model_config.sliding_window", str(bad)], "sliding_window")
    fails(capsys, [*base, "--model.model_config.num_layers", "2", "--model.model_config.layer_types",
                   "[sliding_attention, global]"], "layer_types", "full_attention")  # fmt: skip
    fails(capsys, [*base, "--model.model_config.query_pre_attn_scalar", "0"], "query_pre_attn_scalar")
    fails(capsys, [*base, "--model.model_config.rope_scaling.type", "llama3"], "global_rope_scaling_factor")
    # larger than seq_length is fine: global attention in effect
    cfg = load_config(
        None, ["--model.model_config.type", "Gemma3Config", "--model.model_config.sliding_window", "9999"]
    )
    assert cfg.model.model_config.sliding_window == 9999
    src = tmp_path / "bad"
    src.mkdir()
    save_gemma3(src, tokenizer_dir, GEMMA3)
    config = json.loads((src / "config.json").read_text())
    for change, needle in (
        ({"sliding_window": 0}, "sliding_window=0"),
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"hidden_activation": "gelu"}, "hidden_activation"),
        ({"layer_types": KINDS[:3]}, "layer_types"),
    ):
        (src / "config.json").write_text(json.dumps({**config, **change}))
        before = checksums(tmp_path)
        capsys.readouterr()
        assert main(["import", str(src), "--output", str(tmp_path / "ckpt")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and needle in err and "Traceback" not in err, err
        assert checksums(tmp_path) == before


def test_flops_kv_cache_and_parameters_count_each_layer():
    mc = gemma3_config(seq_length=32)
    family = family_of(mc)
    dense = family.attention_cost(gemma3_config(seq_length=32, sliding_window=None)).flops_per_token
    keys = sum(min(i + 1, WINDOW) for i in range(32))
    causal = 32 * 33 // 2
    assert family.attention_cost(mc).flops_per_token == dense // 4 * (2 * keys + 2 * causal) // causal
    assert family.attention_cost(gemma3_config(seq_length=32, sliding_window=64)).flops_per_token == dense
    assert family.kv_cache_tokens(mc, 100) == 2 * WINDOW + 2 * 100
    model = create_model(mc, 0)
    cache = model.new_kv_cache(1, 100)
    assert sum(t.shape[2] for t in cache.k) == family.kv_cache_tokens(mc, 100)
    for tied in (True, False):
        other = gemma3_config(tie_word_embeddings=tied)
        assert family.param_count(other) == num_params(create_model(other, 0))
    norms = {n: p for n, p in model.named_parameters() if "norm" in n}  # (1 + weight): fresh ones are the identity
    assert len(norms) == 4 * 6 + 1 and all(not p.any() for p in norms.values())


@torch.no_grad()
def test_packed_rows_with_the_window_equal_each_sample_alone():
    model = create_model(gemma3_config(seq_length=40), 0).eval()
    x = text(40)
    assert_packed_rows_equal_each_sample_alone(model, x)


def test_lora_fine_tune_exports_an_adapter_peft_loads_with_the_same_logits(tmp_path, tiny_dataset, tokenizer_dir):
    pytest.importorskip("peft")
    src = tmp_path / "hf"
    src.mkdir()
    hf = {**TINY_HF_LLAMA, "num_hidden_layers": 2, "head_dim": 8, "sliding_window": WINDOW, "sliding_window_pattern": 2,
          "query_pre_attn_scalar": 8, "tie_word_embeddings": False}  # fmt: skip
    save_gemma3(src, tokenizer_dir, hf)
    assert main(["import", str(src), "--output", str(tmp_path / "ckpt")]) == 0
    run, adapter = lora_fine_tune_and_export(tmp_path / "ckpt", tiny_dataset, tmp_path)
    x = text(32)
    cfg, want, loaded = assert_peft_gives_our_logits(run, adapter, x)
    mc = cfg.model.model_config
    assert (mc.type, mc.sliding_window, mc.query_pre_attn_scalar) == ("Gemma3Config", WINDOW, 8)  # the base's
    assert loaded.base_model.model.config.sliding_window == WINDOW


def test_the_planner_is_exact_for_the_family(tiny_dataset, tmp_path):
    """One real training step's measured bytes by component (train/memory.py) against the plan (test_memory.py's
    check), sliding layers' window shorter than the row: activations counted on the real modules, within 1e-3."""
    extra = {
        "model.model_config.type": "Gemma3Config",
        "model.model_config.sliding_window": WINDOW,
        "model.model_config.sliding_window_pattern": 2,
        "model.model_config.query_pre_attn_scalar": 8,
    }
    assert_plan_matches_a_training_step(tiny_dataset, tmp_path, extra)


def test_gguf_export_reads_back_and_loads_in_transformers(tmp_path, tokenizer_dir, capsys):
    """llama.cpp's `gemma3` names with every norm stored plus 1 (its converter's norm_shift): read back by our
    importer (every tensor bit for bit but the norms, kept to 2**-23 of w + 1 in float32) with transformers' logits,
    and loaded by transformers' own GGUF reader (the weights; llama.cpp fixes query_pre_attn_scalar, so the config is
    passed). llama.cpp's fixed choices (every 6th layer global, ...) are refused otherwise, in one line."""
    from conftest import hf_tensors

    src = tmp_path / "hf"
    src.mkdir()
    hf = {**GEMMA3, "num_hidden_layers": 6, "sliding_window_pattern": 6, "query_pre_attn_scalar": 16,
          "rope_local_base_freq": 1e4}  # fmt: skip
    reference = save_gemma3(src, tokenizer_dir, hf)
    assert main(["import", str(src), "--output", str(tmp_path / "ckpt")]) == 0
    out = tmp_path / "gguf" / "model.gguf"
    assert main(["export", str(tmp_path / "ckpt"), "--output", str(out), "--format", "gguf", "--gguf-type", "F32"]) == 0
    assert main(["import", str(out), "--output", str(tmp_path / "back")]) == 0
    ours, cfg, _ = load_for_inference(tmp_path / "back")
    mc = cfg.model.model_config
    assert (mc.type, mc.layer_kinds(), mc.sliding_window, mc.global_rope_scaling_factor) == (
        "Gemma3Config", ["sliding_attention"] * 5 + ["full_attention"], WINDOW, 2.0,
    )  # fmt: skip
    x = text()
    with torch.no_grad():
        want = reference(x).logits
        assert_rel(ours(x), want)
    original = hf_tensors(src)
    mine = {family_of(mc).to_hf(k): v for k, v in ours.state_dict().items()}
    assert sorted(mine) == sorted(original)
    for name, t in original.items():
        if name.endswith("norm.weight"):
            assert (mine[name] - t).abs().max() <= 2**-23 and t.abs().max() > 0.01, name
        else:
            assert torch.equal(mine[name], t), name
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        out.parent, gguf_file=out.name, config=reference.config, dtype=torch.float32
    )
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(x).logits, want, rtol=1e-4, atol=1e-4)
    src2 = tmp_path / "pattern2"
    src2.mkdir()
    save_gemma3(src2, tokenizer_dir, {**hf, "sliding_window_pattern": 2})
    assert main(["import", str(src2), "--output", str(tmp_path / "ckpt2")]) == 0
    fails(capsys, ["export", str(tmp_path / "ckpt2"), "--output", str(tmp_path / "p2.gguf"), "--format", "gguf"],
          "layer_types", "every 6th layer global")  # fmt: skip
    assert not (tmp_path / "p2.gguf").exists()
