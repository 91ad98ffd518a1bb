"""The GLM-4 family (models/glm4/, issue 33 item 4): a tiny random transformers Glm4ForCausalLM (rotary on half of
each head, q/k/v biases, post-block norms, fused gate_up_proj) imports with transformers' logits (fp32, 1e-5 on a
40-token text), exports back bit for bit (the fused projection joined again) and reloads in transformers, passes
`--verify`, and decodes greedily through the KV cache with transformers' tokens. A LoRA fine-tune exports a PEFT
adapter peft loads with the same logits; packed rows equal each sample alone; the planner is exact on CPU; bad
`partial_rotary_factor` values are one line, exit 2."""

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
from meshformer.interop.inference import load_for_inference
from meshformer.models import create_model
from meshformer.models.generate import generate
from meshformer.models.registry import family_for_hf, family_of, model_config

transformers = pytest.importorskip("transformers")

# pad/eos inside the tiny vocabulary (transformers' GLM-4 defaults name ids of the 151k one)
GLM4 = {
    **HF_SMALL,
    "num_key_value_heads": 2,
    "head_dim": 32,  # explicit, unlike hidden_size / heads (16), as GLM-4's configs give it
    "partial_rotary_factor": 0.5,
    "attention_bias": True,
    "rope_theta": 1e4,
    "pad_token_id": 0,
    "eos_token_id": 1,
}


@pytest.fixture
def imported(tmp_path, tokenizer_dir, capsys):
    """(transformers' model, its directory, our checkpoint) of a GLM-4, imported with --verify."""
    src = tmp_path / "glm4"
    reference = save_hf_model(src, tokenizer_dir, GLM4, "Glm4", shard="150KB")
    assert main(["import", str(src), "--output", str(tmp_path / "ckpt"), "--verify"]) == 0
    assert "max |logit difference|" in capsys.readouterr().out
    return reference, src, tmp_path / "ckpt"


def test_glm4_imports_with_transformers_logits_and_exports_bit_for_bit(imported, tmp_path):
    reference, src, ckpt = imported
    ours, cfg, _ = load_for_inference(ckpt)
    mc = cfg.model.model_config
    assert (mc.type, mc.partial_rotary_factor, mc.qkv_has_bias) == ("Glm4Config", 0.5, True)
    layer = ours.layers["0"]
    assert layer.self_attn.q_proj.bias is not None and layer.self_attn.o_proj.bias is None
    assert ours.rope.cos.shape[-1] == mc.dim_per_head // 2  # the rotary turns half of each head
    x = text()
    with torch.no_grad():
        want = reference(x).logits
        got = ours(x)
        fused = reference.model.layers[0].mlp.gate_up_proj.weight
        assert torch.equal(torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]), fused)
    assert_rel(got, want)
    back = exports_as_the_original(src, ckpt, tmp_path / "out", x, want)
    assert back.config.rope_parameters["partial_rotary_factor"] == 0.5
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["architectures"] == ["Glm4ForCausalLM"] and exported["attention_bias"] is True
    assert family_for_hf({"architectures": ["Glm4ForCausalLM"]}, "c.json")[0].name == "glm4"


def test_every_difference_from_llama_decides_the_logits(imported):
    """Each of GLM-4's own parts matters on this model: without it the logits are not transformers'."""
    reference, _, ckpt = imported
    x = text()
    with torch.no_grad():
        want = reference(x).logits
        for change in ("full_rotary", "no_post_norms"):
            ours, _, _ = load_for_inference(ckpt)
            if change == "full_rotary":  # Llama's rotary over the whole head (tables rebuilt for it)
                from meshformer.models.llama.model import RopeTables

                ours.rope = RopeTables(ours.config)
                ours.rope.reset_parameters()
            else:
                for layer in ours.layers.values():
                    layer.post_self_attn_layernorm = layer.post_mlp_layernorm = torch.nn.Identity()
            assert (ours(x) - want).abs().max() > 1e-2, change


def test_greedy_generation_gives_transformers_tokens(imported):
    reference, _, ckpt = imported
    ours, _, _ = load_for_inference(ckpt)
    prompt = [5, 17, 42, 3, 99, 7, 61, 8, 250, 31, 4]
    with torch.no_grad():
        want = reference.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert generate(ours, prompt, 20, greedy=True) == want[0, len(prompt) :].tolist()


def test_another_rotary_fraction_and_no_biases_import_too(tmp_path, tokenizer_dir):
    src = tmp_path / "glm4"
    config = {**GLM4, "partial_rotary_factor": 0.75, "attention_bias": False, "head_dim": 24}
    reference = save_hf_model(src, tokenizer_dir, config, "Glm4")
    assert main(["import", str(src), "--output", str(tmp_path / "ckpt")]) == 0
    ours, cfg, _ = load_for_inference(tmp_path / "ckpt")
    mc = cfg.model.model_config
    assert (mc.partial_rotary_factor, mc.qkv_has_bias, ours.rope.cos.shape[-1]) == (0.75, False, 18)
    x = text()
    with torch.no_grad():
        want = reference(x).logits
        assert_rel(ours(x), want)
    exports_as_the_original(src, tmp_path / "ckpt", tmp_path / "out", x, want)


def test_bad_rotary_fractions_are_one_line(tmp_path, tokenizer_dir, capsys):
    base = ["config", "check", EMPTY, "--model.model_config.type", "Glm4Config"]
    for bad in ("0", "-0.5", "1.5"):
        fails(capsys, [*base, "--model.model_config.partial_rotary_factor", bad], "partial_rotary_factor")
    # head_dim 16 x 0.3 = 4.8: 4 channels, fine; x 0.2 = 3.2: 3 channels, an odd rotary width
    fails(capsys, [*base, "--model.model_config.hidden_size", "64", "--model.model_config.num_heads", "4",
                   "--model.model_config.partial_rotary_factor", "0.2"], "partial_rotary_factor", "even")  # fmt: skip
    cfg = load_config(
        None, ["--model.model_config.type", "Glm4Config", "--model.model_config.partial_rotary_factor", "1"]
    )
    assert cfg.model.model_config.partial_rotary_factor == 1.0
    src = tmp_path / "bad"
    save_hf_model(src, tokenizer_dir, GLM4, "Glm4")
    config = json.loads((src / "config.json").read_text())
    config["rope_parameters"]["partial_rotary_factor"] = 1.5
    (src / "config.json").write_text(json.dumps(config))
    before = checksums(tmp_path)
    capsys.readouterr()
    assert main(["import", str(src), "--output", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "partial_rotary_factor=1.5" in err and "Traceback" not in err, err
    assert checksums(tmp_path) == before


@torch.no_grad()
def test_packed_rows_equal_each_sample_alone():
    mc = model_config(
        type="Glm4Config", hidden_size=64, num_layers=2, num_heads=4, n_kv_heads=2, vocab_size=512,
        intermediate_size=96, seq_length=40,
    )  # fmt: skip
    model = create_model(mc, 0).eval()
    x = text(40)
    assert_packed_rows_equal_each_sample_alone(model, x)


def test_param_count_and_flops_count_the_extra_norms():
    mc = model_config(type="Glm4Config", hidden_size=64, num_layers=3, num_heads=4, n_kv_heads=2, vocab_size=512,
                      intermediate_size=96)  # fmt: skip
    family = family_of(mc)
    model = create_model(mc, 0)
    assert family.param_count(mc) == sum(p.numel() for p in model.parameters())
    llama = model_config(type="Qwen2Config", hidden_size=64, num_layers=3, num_heads=4, n_kv_heads=2, vocab_size=512,
                         intermediate_size=96)  # fmt: skip
    assert family.param_count(mc) == family_of(llama).param_count(llama) + 3 * 2 * 64  # two norms a layer


def test_lora_fine_tune_exports_an_adapter_peft_loads_with_the_same_logits(tmp_path, tiny_dataset, tokenizer_dir):
    pytest.importorskip("peft")
    from conftest import TINY_HF_LLAMA

    src = tmp_path / "hf"
    save_hf_model(src, tokenizer_dir, {**TINY_HF_LLAMA, "partial_rotary_factor": 0.5, "pad_token_id": 0,
                                       "eos_token_id": 1}, "Glm4")  # fmt: skip
    assert main(["import", str(src), "--output", str(tmp_path / "ckpt")]) == 0
    run, adapter = lora_fine_tune_and_export(tmp_path / "ckpt", tiny_dataset, tmp_path)
    x = text(32)
    cfg, want, loaded = assert_peft_gives_our_logits(run, adapter, x)
    mc = cfg.model.model_config
    assert (mc.type, mc.partial_rotary_factor, mc.qkv_has_bias) == ("Glm4Config", 0.5, True)  # the base's


def test_the_planner_is_exact_for_the_family(tiny_dataset, tmp_path):
    """One real training step's measured bytes by component (train/memory.py) against the plan (test_memory.py's
    check): activations counted on the real modules (the post-block norms included), within 1e-3."""
    extra = {"model.model_config.type": "Glm4Config"}
    assert_plan_matches_a_training_step(tiny_dataset, tmp_path, extra)


def test_a_peft_adapter_of_gate_or_up_alone_is_refused_naming_the_fused_projection():
    """PEFT names GLM-4's MLP input as one gate_up_proj: an adapter on our gate_proj (or up_proj) alone has no such
    name, so its export is refused in one line pointing at the targets that have one, or --merge-lora."""
    from meshformer.errors import UserError

    mc = model_config(type="Glm4Config")
    family = family_of(mc)
    gate = torch.zeros(4, 8)
    with pytest.raises(UserError, match="gate_up_proj.*--merge-lora"):
        family.to_hf_state({"layers.0.mlp.gate_proj.weight": gate}, mc)
    both = family.to_hf_state({"layers.0.mlp.gate_proj.weight": gate, "layers.0.mlp.up_proj.weight": gate + 1}, mc)
    assert list(both) == ["model.layers.0.mlp.gate_up_proj.weight"] and both[next(iter(both))][4:].eq(1).all()


def test_gguf_export_has_llama_cpp_glm4_names_and_reads_back_bit_for_bit(imported, tmp_path):
    """`export --format gguf` writes llama.cpp's `glm4` architecture as its converter does (the fused gate_up_proj as
    ffn_up, the post-block norms, q/k unpermuted, rope.dimension_count the rotary's width); importing the file gives
    transformers' logits and exports the original tensors bit for bit (F32)."""
    gguf = pytest.importorskip("gguf")
    reference, src, ckpt = imported
    out = tmp_path / "glm4.gguf"
    assert main(["export", str(ckpt), "--output", str(out), "--format", "gguf", "--gguf-type", "F32"]) == 0
    reader = gguf.GGUFReader(str(out))
    meta = {name: field.contents() for name, field in reader.fields.items()}
    assert meta["general.architecture"] == "glm4"
    assert (meta["glm4.rope.dimension_count"], meta["glm4.attention.key_length"]) == (16, 32)
    stored = {t.name: t for t in reader.tensors}
    assert {"blk.0.post_attention_norm.weight", "blk.0.post_ffw_norm.weight", "blk.0.attn_q.bias"} <= set(stored)
    assert "blk.0.ffn_gate.weight" not in stored
    fused = reference.model.layers[0].mlp.gate_up_proj.weight
    q = reference.model.layers[0].self_attn.q_proj.weight
    for name, want in (("blk.0.ffn_up.weight", fused), ("blk.0.attn_q.weight", q)):
        raw = torch.from_numpy(stored[name].data.copy()).reshape(want.shape)
        assert torch.equal(raw, want), name
    assert main(["import", str(out), "--output", str(tmp_path / "back")]) == 0
    ours, cfg, _ = load_for_inference(tmp_path / "back")
    assert cfg.model.model_config.partial_rotary_factor == 0.5
    x = text()
    with torch.no_grad():
        want = reference(x).logits
        assert_rel(ours(x), want)
    exports_as_the_original(src, tmp_path / "back", tmp_path / "hf", x, want)


def test_a_mindspore_transformers_glm4_yaml_loads_into_the_family(tmp_path):
    """MindSpore Transformers' GLM-4 model_config (its Glm4Config, mindformers/models/glm4/configuration_glm4.py)
    spells the shape in transformers' names, next to predict_glm4.yaml's dtype keys: it loads as the same model a
    config.json import gives."""
    yaml = tmp_path / "glm4.yaml"
    yaml.write_text(
        "run_mode: 'predict'\nuse_legacy: False\nload_ckpt_format: 'safetensors'\n"
        "trainer:\n  type: CausalLanguageModelingTrainer\n  model_name: 'glm4'\n"
        "model:\n  model_config:\n    type: Glm4Config\n"
        "    vocab_size: 512\n    hidden_size: 64\n    intermediate_size: 128\n    num_hidden_layers: 2\n"
        "    num_attention_heads: 4\n    num_key_value_heads: 2\n    head_dim: 32\n    partial_rotary_factor: 0.5\n"
        "    max_position_embeddings: 256\n    rms_norm_eps: 1.0e-6\n    rope_theta: 10000.0\n"
        "    attention_bias: True\n"
        '    compute_dtype: "bfloat16"\n    layernorm_compute_dtype: "float32"\n    softmax_compute_dtype: "float32"\n'
        '    rotary_dtype: "bfloat16"\n    params_dtype: "bfloat16"\n'
    )
    mc = load_config(yaml).model.model_config
    from meshformer.models.glm4.hf import config_from_hf

    want = config_from_hf({**GLM4, "architectures": ["Glm4ForCausalLM"]})
    for key, value in want.items():
        if key not in ("seq_length", "rope_scaling", "pad_token_id", "eos_token_id"):
            assert getattr(mc, key) == value, key
    assert (mc.compute_dtype, mc.param_init_type, mc.rotary_dtype) == ("bfloat16", "bfloat16", "bfloat16")
