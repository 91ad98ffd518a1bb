"""Hugging Face import and export, proven against `transformers`: tiny random Llama (tied and untied, GQA ratios
1 and 4, llama3 rope scaling), Qwen2 (q/k/v bias) and Qwen3 (q/k norm) models built and saved (sharded) by
transformers itself; import gives its logits within 1e-4 (fp32), export reloads in transformers with no missing or
unexpected weights and the same logits, and import -> export reproduces every tensor bit for bit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import (
    HF_SMALL,
    TINY_HF_LLAMA,
    checksums,
    exports_as_the_original,
    imports_with_its_logits,
    save_hf_model,
    tokens,
)
from meshformer.cli.main import main
from meshformer.errors import RunFailed
from meshformer.interop import parity
from meshformer.interop.inference import load_for_inference

transformers = pytest.importorskip("transformers")

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
CASES = {  # name: (transformers class names, config overrides)
    "llama_untied_gqa1": ("Llama", dict(num_key_value_heads=4, rope_theta=50000.0)),
    "llama_tied_gqa4": ("Llama", dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True)),
    "llama31_rope_scaling": ("Llama", dict(num_key_value_heads=2, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE)),
    "qwen2_qkv_bias": ("Qwen2", dict(num_key_value_heads=2, rope_theta=1e6)),
    "qwen3_qk_norm": ("Qwen3", dict(num_key_value_heads=2, head_dim=32, rope_theta=1e6)),
}


def hf_model(family: str, overrides: dict, out: Path, tokenizer_dir: Path):
    """A randomly initialised transformers model (weights spread beyond init), saved in 6-ish shards."""
    return save_hf_model(out, tokenizer_dir, {**HF_SMALL, **overrides}, family, shard="100KB")


@pytest.mark.parametrize("case", list(CASES))
def test_import_export_round_trip_matches_transformers(case, tmp_path, tokenizer_dir, capsys):
    family, overrides = CASES[case]
    src = tmp_path / "hf"
    reference = hf_model(family, overrides, src, tokenizer_dir)
    assert len(list(src.glob("*.safetensors"))) > 1  # really sharded, with an index
    x, want, _ = imports_with_its_logits(reference, src, tmp_path / "ckpt", capsys)
    exports_as_the_original(src, tmp_path / "ckpt", tmp_path / "out", x, want)  # same logits, tensors bit for bit
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tok.eos_token == "<|endoftext|>" and tok("to be").input_ids  # the tokenizer travels along


def test_pytorch_bin_weights_are_read_without_unpickling_code(tmp_path, tokenizer_dir):
    src = tmp_path / "hf"
    reference = hf_model("Llama", {"num_key_value_heads": 2}, src, tokenizer_dir)
    for f in src.glob("model*.safetensors*"):
        f.unlink()
    torch.save(reference.state_dict(), src / "pytorch_model.bin")
    assert main(["import", str(src), "--output", str(tmp_path / "ckpt")]) == 0
    ours, _, _ = load_for_inference(tmp_path / "ckpt")
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(ours(x), reference(x).logits, rtol=1e-4, atol=1e-4)


def test_verify_fails_above_the_tolerance(tmp_path, tokenizer_dir):
    src = tmp_path / "hf"
    hf_model("Llama", {"num_key_value_heads": 2}, src, tokenizer_dir)
    assert main(["import", str(src), "--output", str(tmp_path / "ckpt")]) == 0
    model, _, tok = load_for_inference(tmp_path / "ckpt")
    with torch.no_grad():
        model.layers["1"].mlp.down_proj.weight.mul_(1.01)  # a conversion bug of 1%
    with pytest.raises(RunFailed, match="differs from transformers' by"):
        parity.verify(model, tok, src, log=lambda s: None)


def _bad_sources(tmp_path: Path, tokenizer_dir: Path) -> dict[str, tuple[Path, str]]:
    good = tmp_path / "good"
    hf_model("Llama", {"num_key_value_heads": 2}, good, tokenizer_dir)
    cases = {}

    def variant(name: str) -> Path:
        d = tmp_path / name
        shutil.copytree(good, d)
        return d

    d = variant("arch")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "architectures": ["FalconForCausalLM"], "model_type": "falcon"}))
    cases["arch"] = (d, "architecture 'FalconForCausalLM' is not supported")
    d = variant("shard")
    (d / "model-00002-of-00006.safetensors").unlink()
    cases["shard"] = (d, "shard model-00002-of-00006.safetensors listed in model.safetensors.index.json is missing")
    d = variant("shape")
    (d / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    cases["shape"] = (d, r"the weights do not match its config \(6 shape\(s\) differ")
    d = variant("rope")
    (d / "config.json").write_text(json.dumps({**cfg, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))
    cases["rope"] = (d, "rope scaling 'yarn' is not supported")
    cases["missing"] = (tmp_path / "nowhere", "not a Hugging Face model directory")
    return cases


def test_bad_sources_are_one_line_exit_2_and_write_nothing(tmp_path, tokenizer_dir, capsys):
    import re

    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    for name, (src, message) in _bad_sources(tmp_path, tokenizer_dir).items():
        before = checksums(tmp_path)
        capsys.readouterr()
        assert main(["import", str(src), "--output", str(tmp_path / f"out_{name}")]) == 2, name
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and re.search(message, err), (name, err)
        assert checksums(tmp_path) == before, name  # nothing written, nothing changed
        assert not list(tmp_path.glob(f"out_{name}*")), name  # not even an empty directory
    good = tmp_path / "good"
    assert main(["import", str(good), "--output", str(existing)]) == 2  # an existing output is never touched
    assert "already exists" in capsys.readouterr().err and (existing / "keep.txt").read_text() == "mine"


def test_training_starts_from_a_hugging_face_directory_like_from_its_import(tmp_path, tiny_dataset, tokenizer_dir):
    from conftest import tiny_overrides
    from meshformer.cli.train_cmd import run_training  # load_checkpoint: a Hugging Face directory
    from meshformer.config import load_config

    src = tmp_path / "hf"
    hf_model("Llama", TINY_HF_LLAMA, src, tokenizer_dir)  # the tiny dataset's model shape
    assert main(["import", str(src), "--output", str(tmp_path / "ckpt")]) == 0
    losses = []
    for name, load in (("from_hf", src), ("from_import", tmp_path / "ckpt")):
        extra = {"load_checkpoint": str(load), "runner_config.stop_step": 2, "model.model_config.rms_norm_eps": 1e-5}
        last = run_training(load_config(None, tiny_overrides(tiny_dataset, tmp_path / name, extra)))
        first = json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0])
        losses.append((first["loss"], last["loss"]))
    assert losses[0] == losses[1]
    fresh = run_training(
        load_config(None, tiny_overrides(tiny_dataset, tmp_path / "fresh", {"runner_config.stop_step": 2}))
    )
    assert fresh["loss"] != losses[0][1]  # the loaded weights mattered
    wrong = {"load_checkpoint": str(src), "model.model_config.intermediate_size": 96}
    with pytest.raises(Exception, match="is another model than model.model_config describes"):
        run_training(load_config(None, tiny_overrides(tiny_dataset, tmp_path / "wrong", wrong)))


def test_gguf_export_loads_in_transformers_within_the_quantization_error(tmp_path, tokenizer_dir):
    src = tmp_path / "hf"
    reference = hf_model("Llama", {"num_key_value_heads": 2}, src, tokenizer_dir)
    assert main(["import", str(src), "--output", str(tmp_path / "ckpt")]) == 0
    x = tokens()
    with torch.no_grad():
        want = reference(x).logits
    for qtype, tol in (("F16", 1e-2), ("Q8_0", 5e-2)):
        out = tmp_path / f"model-{qtype}.gguf"
        assert (
            main(["export", str(tmp_path / "ckpt"), "--output", str(out), "--format", "gguf", "--gguf-type", qtype])
            == 0
        )
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=out.name, dtype=torch.float32)
        with torch.no_grad():
            diff = (loaded.eval()(x).logits - want).abs().max().item()
        print(f"GGUF {qtype}: max |logit difference| {diff:.2e}")
        assert diff < tol, (qtype, diff)


def test_finetune_takes_the_model_shape_from_load_checkpoint(tmp_path, tiny_dataset, tokenizer_dir):
    from meshformer.cli.train_cmd import run_training  # load_checkpoint: a Hugging Face directory
    from meshformer.config import load_config
    from meshformer.errors import UserError

    src = tmp_path / "hf"
    hf_model("Llama", {**TINY_HF_LLAMA, "max_position_embeddings": 64, "rms_norm_eps": 1e-6}, src, tokenizer_dir)
    run = [  # no architecture at all: run_mode finetune takes it from the Hugging Face directory
        "--run_mode", "finetune", "--load_checkpoint", str(src), "--model.model_config.seq_length", "32",
        "--train_dataset.data_loader.dataset_dir", str(tiny_dataset), "--train_dataset.batch_size", "4",
        "--runner_config.stop_step", "2", "--monitor_config.peak_flops", "1e12",
    ]  # fmt: skip
    run_training(load_config(None, [*run, "--output_dir", str(tmp_path / "a")]))
    saved = load_config(sorted((tmp_path / "a" / "checkpoint").iterdir())[-1] / "config.yaml")
    mc = saved.model.model_config
    assert (mc.hidden_size, mc.num_layers, mc.n_kv_heads, mc.intermediate_size, mc.vocab_size) == (32, 2, 2, 64, 512)
    assert mc.seq_length == 32  # the run's own
    with pytest.raises(UserError, match="model.model_config.hidden_size=64 but the model in load_checkpoint has 32"):
        run_training(
            load_config(None, [*run, "--output_dir", str(tmp_path / "b"), "--model.model_config.hidden_size", "64"])
        )
    with pytest.raises(UserError, match="run_mode: finetune needs load_checkpoint"):
        run_training(load_config(None, ["--run_mode", "finetune", "--output_dir", str(tmp_path / "c")]))


def test_eval_command_reports_the_perplexity_transformers_computes(tmp_path, tokenizer_dir, capsys):
    src = tmp_path / "hf"
    reference = hf_model("Llama", {"num_key_value_heads": 2}, src, tokenizer_dir)
    assert main(["import", str(src), "--output", str(tmp_path / "ckpt")]) == 0
    text = tmp_path / "para.txt"
    text.write_text(parity.PARAGRAPH)
    capsys.readouterr()
    assert (
        main(["eval", "--checkpoint", str(tmp_path / "ckpt"), "--input", str(text), "--json", "--seq-length", "64"])
        == 0
    )
    got = json.loads(capsys.readouterr().out)
    _, _, tok = load_for_inference(tmp_path / "ckpt")
    ids = tok.encode(parity.PARAGRAPH).ids
    total = 0.0
    with torch.no_grad():
        for s in range(0, len(ids) - 1, 64):
            w = torch.tensor([ids[s : s + 65]])
            total += torch.nn.functional.cross_entropy(reference(w[:, :-1]).logits[0], w[0, 1:], reduction="sum").item()
    assert got["tokens"] == len(ids) - 1
    assert abs(got["loss"] - total / (len(ids) - 1)) < 1e-4
    assert main(["eval", "--checkpoint", str(tmp_path / "ckpt"), "--input", str(tmp_path / "none.txt")]) == 2
