"""MindSpore Transformers checkpoints in and out, proven against mindspore and transformers.

A tiny transformers Llama (GQA) and Qwen2 (q/k/v biases; also tied) are renamed to MindSpore Transformers' names by
the published map (its convert_weight.py's `name_replace`, restated here, not meshformer's), optionally fused by the
published `qkv_concat_hf2mg` / `ffn_concat_hf2mg` (restated in numpy), saved by `mindspore.save_checkpoint`, and
imported with a MindSpore Transformers YAML: the model scores transformers' perplexity within 1e-5 relative (fp32),
and `export --format mindspore` gives `mindspore.load_checkpoint` the very tensors that were saved. The file format is
checked against MindSpore's own writer and reader: bf16/fp16, CRC footer, parameters split into slices, the
safetensors form. Bad inputs are one line and exit 2, and nothing is written.
"""

from __future__ import annotations

import re
from pathlib import Path

import mindspore as ms
import numpy as np
import torch
import transformers
import yaml

from conftest import HF_SMALL, checksums, tokens
from meshformer.cli.main import main
from meshformer.interop import mindspore_ckpt
from meshformer.interop.inference import load_for_inference
from meshformer.interop.mindspore_ckpt import read_mindspore_checkpoint

# mindformers/models/llama/convert_weight.py `name_replace` (Hugging Face -> MindSpore Transformers), in its order.
PUBLISHED_NAMES = [
    ("embed_tokens.weight", "tok_embeddings.embedding_weight"),
    (".self_attn.q_proj.", ".attention.wq."),
    (".self_attn.k_proj.", ".attention.wk."),
    (".self_attn.v_proj.", ".attention.wv."),
    (".self_attn.o_proj.", ".attention.wo."),
    (".mlp.gate_proj.", ".feed_forward.w1."),
    (".mlp.down_proj.", ".feed_forward.w2."),
    (".mlp.up_proj.", ".feed_forward.w3."),
    (".input_layernorm.", ".attention_norm."),
    (".post_attention_layernorm.", ".ffn_norm."),
    (".norm.", ".norm_out."),
]
CASES = {  # name: (transformers family, config overrides, fused)
    "llama_gqa": ("Llama", dict(num_key_value_heads=2, rope_theta=50000.0), False),
    "llama_gqa_fused": ("Llama", dict(num_key_value_heads=2, rope_theta=50000.0), True),
    "qwen2_bias": ("Qwen2", dict(num_key_value_heads=2, rope_theta=1e6), False),
    "qwen2_bias_tied_fused": ("Qwen2", dict(num_key_value_heads=1, rope_theta=1e6, tie_word_embeddings=True), True),
}


def published_name(hf_name: str) -> str:
    for old, new in PUBLISHED_NAMES:
        hf_name = hf_name.replace(old, new)
    return hf_name


def qkv_concat_hf2mg(w: np.ndarray, num_heads: int, n_kv_heads: int, hidden_size: int) -> np.ndarray:
    """mindformers/utils/convert_utils.py's function: [q; k; v] rows regrouped per key/value head."""
    shape = w.shape
    rows = w.reshape(shape[0], -1)
    kv_rows = hidden_size // (num_heads // n_kv_heads)
    q, k, v = rows[:hidden_size], rows[hidden_size : hidden_size + kv_rows], rows[hidden_size + kv_rows :]
    q = q.reshape(n_kv_heads, hidden_size // n_kv_heads, -1)
    k = k.reshape(n_kv_heads, hidden_size // num_heads, -1)
    v = v.reshape(n_kv_heads, hidden_size // num_heads, -1)
    return np.concatenate((q, k, v), axis=1).reshape(shape)


def ffn_concat_hf2mg(w: np.ndarray, ffn_hidden_size: int) -> np.ndarray:
    """mindformers/utils/convert_utils.py's function: [gate; up] rows interleaved."""
    gate, up = w[:ffn_hidden_size], w[ffn_hidden_size:]
    pairs = np.concatenate((gate.reshape(ffn_hidden_size, 1, -1), up.reshape(ffn_hidden_size, 1, -1)), axis=1)
    return pairs.reshape(w.shape)


def mindspore_weights(model, fused: bool) -> dict[str, np.ndarray]:
    """A transformers model's weights as MindSpore Transformers' converter writes them (qkv_concat: fused)."""
    cfg = model.config
    out = {published_name(k): v.detach().numpy().copy() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight")  # its Qwen2 0.5B checkpoints have no head of their own
    if not fused:
        return out
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        for kind in ("weight", "bias"):
            if f"{pre}attention.wq.{kind}" in out:
                qkv = np.concatenate([out.pop(f"{pre}attention.{w}.{kind}") for w in ("wq", "wk", "wv")])
                heads, kv, h = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size
                out[f"{pre}attention.w_qkv.{kind}"] = qkv_concat_hf2mg(qkv, heads, kv, h)
        gate_up = np.concatenate([out.pop(f"{pre}feed_forward.{w}.weight") for w in ("w1", "w3")])
        out[f"{pre}feed_forward.w_gate_hidden.weight"] = ffn_concat_hf2mg(gate_up, cfg.intermediate_size)
    return out


def save_ms(weights: dict[str, np.ndarray], path: Path, dtype=ms.float32, **kwargs) -> Path:
    ms.save_checkpoint([{"name": k, "data": ms.Tensor(v, dtype)} for k, v in weights.items()], str(path), **kwargs)
    return path


def mindformers_yaml(path: Path, hf_cfg, tokenizer: Path | None, fused: bool) -> Path:
    """A MindSpore Transformers YAML for the model (its field names, sections meshformer only notes)."""
    model_config = {
        "type": "LlamaConfig",
        "batch_size": 1,
        "seq_length": 64,
        "hidden_size": hf_cfg.hidden_size,
        "num_layers": hf_cfg.num_hidden_layers,
        "num_heads": hf_cfg.num_attention_heads,
        "n_kv_heads": hf_cfg.num_key_value_heads,
        "intermediate_size": hf_cfg.intermediate_size,
        "vocab_size": hf_cfg.vocab_size,
        "rms_norm_eps": hf_cfg.rms_norm_eps,
        "theta": float(hf_cfg.rope_parameters["rope_theta"]),
        "qkv_has_bias": hf_cfg.model_type == "qwen2",
        "tie_word_embeddings": bool(hf_cfg.tie_word_embeddings),
        "qkv_concat": fused,
        "compute_dtype": "float32",
        "layernorm_compute_type": "float32",
        "softmax_compute_type": "float32",
        "rotary_dtype": "float32",
        "param_init_type": "float32",
        "use_past": False,
        "use_flash_attention": True,
        "checkpoint_name_or_path": "",
    }
    data = {
        "seed": 0,
        "run_mode": "finetune",
        "runner_config": {"epochs": 1, "batch_size": 1, "sink_mode": True, "sink_size": 1},
        "parallel_config": {"data_parallel": 8, "model_parallel": 1, "pipeline_stage": 1},
        "context": {"mode": 0, "device_target": "Ascend", "max_device_memory": "58GB"},
        "model": {"model_config": model_config, "arch": {"type": "LlamaForCausalLM"}},
        "processor": {"return_tensors": "ms", "type": "LlamaProcessor", "tokenizer": {"type": "LlamaTokenizerFast"}},
    }
    if tokenizer is not None:
        data["processor"]["tokenizer"]["tokenizer_file"] = str(tokenizer / "tokenizer.json")
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def hf_model(family: str, overrides: dict):
    """A seeded transformers model, weights spread beyond init (so a swapped row would show)."""
    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(**{**HF_SMALL, **overrides})
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def perplexity(logits: torch.Tensor, x: torch.Tensor) -> float:
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
    return float(torch.exp(loss.double()))


def loaded(path: Path) -> dict[str, torch.Tensor]:
    """mindspore.load_checkpoint's tensors (bf16 through MindSpore's own cast: its numpy has no bfloat16)."""
    out = {}
    for k, p in ms.load_checkpoint(str(path)).items():
        if p.dtype == ms.bfloat16:
            out[k] = torch.from_numpy(ms.ops.cast(p, ms.float32).asnumpy()).bfloat16()
        else:
            out[k] = torch.from_numpy(p.asnumpy())
    return out


def test_import_scores_transformers_perplexity_and_exports_back_identical(tmp_path, tokenizer_dir, capsys):
    x = tokens()
    for case, (family, overrides, fused) in CASES.items():
        d = tmp_path / case
        d.mkdir()
        reference = hf_model(family, overrides)
        weights = mindspore_weights(reference, fused)
        assert any("w_qkv" in k for k in weights) == fused
        ckpt = save_ms(weights, d / "model.ckpt")
        config = mindformers_yaml(d / "run.yaml", reference.config, tokenizer_dir, fused)
        assert main(["import", str(ckpt), "--config", str(config), "--output", str(d / "imported")]) == 0, case

        ours, cfg, _ = load_for_inference(d / "imported")
        assert cfg.model.model_config.qkv_has_bias == (family == "Qwen2")
        with torch.no_grad():
            want, got = reference(x).logits, ours(x)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert abs(perplexity(got, x) / perplexity(want, x) - 1) < 1e-5, case

        out = d / "back.ckpt"
        export = ["export", str(d / "imported"), "--format", "mindspore", "--output", str(out)]
        assert main(export + ["--fused"] * fused) == 0, case
        assert main(export) == 2  # an existing file is never overwritten
        back = loaded(out)
        assert sorted(back) == sorted(weights), case
        for name, saved in weights.items():
            assert torch.equal(back[name], torch.from_numpy(saved)), (case, name)
    capsys.readouterr()


def test_training_checkpoint_imports_its_model_and_exports_to_bf16_and_safetensors(tmp_path, tokenizer_dir, capsys):
    reference = hf_model("Qwen2", dict(num_key_value_heads=2))
    weights = mindspore_weights(reference, fused=False)
    moments = {f"adam_m.{k}": np.zeros_like(v) for k, v in weights.items()}  # as a training run saves them
    ckpt = save_ms(weights | moments, tmp_path / "model.ckpt", append_dict={"epoch_num": 1, "global_step": 10})
    config = mindformers_yaml(tmp_path / "run.yaml", reference.config, tokenizer_dir, False)
    hub = tmp_path / "Qwen2.5"  # a hub download: MindSpore's YAML names its vocab.json, tokenizer.json is beside it
    hub.mkdir()
    (hub / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    (hub / "vocab.json").write_text("{}")
    text = config.read_text().replace(
        f"tokenizer_file: {tokenizer_dir / 'tokenizer.json'}", f"vocab_file: {hub}/vocab.json"
    )
    config.write_text(text)
    assert "vocab_file" in config.read_text()
    capsys.readouterr()
    assert main(["import", str(ckpt), "--config", str(config), "--output", str(tmp_path / "imported")]) == 0
    err = capsys.readouterr().err
    assert f"note: {len(moments) + 2} training-state entries not imported" in err
    assert f"using {hub / 'tokenizer.json'} beside it" in err
    assert (tmp_path / "imported" / "tokenizer.json").read_bytes() == (hub / "tokenizer.json").read_bytes()
    bf16 = tmp_path / "bf16.ckpt"
    assert (
        main(
            [
                "export",
                str(tmp_path / "imported"),
                "--format",
                "mindspore",
                "--output",
                str(bf16),
                "--dtype",
                "bfloat16",
            ]
        )
        == 0
    )
    back = loaded(bf16)
    assert all(t.dtype == torch.bfloat16 for t in back.values())
    for name, saved in weights.items():
        assert torch.equal(back[name], torch.from_numpy(saved).bfloat16()), name
    st = tmp_path / "model.safetensors"
    assert main(["export", str(tmp_path / "imported"), "--format", "mindspore", "--output", str(st), "--fused"]) == 0
    back = {k: torch.from_numpy(p.asnumpy()) for k, p in ms.load_checkpoint(str(st), format="safetensors").items()}
    want = mindspore_weights(reference, fused=True)
    assert sorted(back) == sorted(want)
    assert all(torch.equal(back[k], torch.from_numpy(v)) for k, v in want.items())
    # and its safetensors form imports like the .ckpt
    assert main(["import", str(st), "--config", str(config), "--output", str(tmp_path / "from_st")]) == 0
    a, _, _ = load_for_inference(tmp_path / "imported")
    b, _, _ = load_for_inference(tmp_path / "from_st")
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())


def test_file_format_matches_mindspore_slices_crc_and_dtypes(tmp_path, monkeypatch):
    """What MindSpore writes (bf16, fp16, a CRC footer, a parameter split over several values, scalars and
    training state) reads as MindSpore reads it; what meshformer writes, in slices, is byte for byte MindSpore's."""
    import mindspore.train.serialization as ser

    rng = np.random.default_rng(0)
    weights = {
        "model.tok_embeddings.embedding_weight": rng.standard_normal((300, 16)).astype(np.float32),
        "model.norm_out.weight": rng.standard_normal(16).astype(np.float32),
    }
    monkeypatch.setattr(ser, "SLICE_SIZE", 4)  # KB: the 300 x 16 embedding becomes several values of one tag
    for dtype, name in ((ms.bfloat16, "bf16"), (ms.float16, "fp16"), (ms.float32, "fp32")):
        f = tmp_path / f"{name}.ckpt"
        items = [{"name": k, "data": ms.Tensor(v, dtype)} for k, v in weights.items()]
        items += [{"name": "adam_m.model.norm_out.weight", "data": ms.Tensor(weights["model.norm_out.weight"])}]
        ms.save_checkpoint(items, str(f), crc_check=True, append_dict={"epoch_num": 3, "step_num": 7})
        assert f.read_bytes().count(b"model.tok_embeddings.embedding_weight") > 1  # really sliced
        assert f.read_bytes()[-17:-10] == b"crc_num"
        got = read_mindspore_checkpoint(f)
        assert sorted(got.training_state) == ["adam_m.model.norm_out.weight", "epoch_num", "step_num"]
        want = loaded(f)
        assert sorted(got.tensors) == sorted(weights)
        for k, t in got.tensors.items():
            assert t.dtype == want[k].dtype and torch.equal(t, want[k]), (name, k)
    # meshformer's writer, sliced the same way, read by MindSpore
    monkeypatch.setattr(mindspore_ckpt, "SLICE_BYTES", 4096)
    ours = {k: torch.from_numpy(v) for k, v in weights.items()} | {"scalar": torch.tensor(5, dtype=torch.int32)}
    f = mindspore_ckpt.write_mindspore_checkpoint(tmp_path / "ours.ckpt", ours)
    assert f.read_bytes().count(b"model.tok_embeddings.embedding_weight") > 1
    back = loaded(f)
    assert sorted(back) == sorted(ours) and all(torch.equal(back[k], v) for k, v in ours.items())
    same = [{"name": k, "data": ms.Tensor(v.numpy())} for k, v in ours.items()]
    ms.save_checkpoint(same, str(tmp_path / "theirs.ckpt"))  # SLICE_SIZE still patched: the same slices
    assert f.read_bytes() == (tmp_path / "theirs.ckpt").read_bytes()  # byte for byte what MindSpore writes
    again = read_mindspore_checkpoint(f).tensors
    assert sorted(again) == sorted(ours) and all(torch.equal(again[k], v) for k, v in ours.items())


def _bad_inputs(tmp_path: Path, tokenizer_dir: Path) -> dict[str, tuple[list[str], str]]:
    reference = hf_model("Llama", dict(num_key_value_heads=2))
    weights = mindspore_weights(reference, fused=False)
    config = mindformers_yaml(tmp_path / "run.yaml", reference.config, tokenizer_dir, False)
    cases = {}

    def case(name: str, w: dict, message: str, yaml_file: Path = config) -> str:
        (tmp_path / name).mkdir()
        ckpt = str(save_ms(w, tmp_path / name / "model.ckpt"))
        cases[name] = (["--config", str(yaml_file), ckpt], message)
        return ckpt

    hf_named = {k.replace(".attention.wq.", ".self_attn.q_proj."): v for k, v in weights.items()}
    unknown = case("unknown", hf_named, r"tensor 'model\.layers\.0\.self_attn\.q_proj\.weight' is no MindSpore")
    missing = case(
        "missing",
        {k: v for k, v in weights.items() if ".1.attention.wo." not in k},
        "layers.1.attention.wo.weight is missing",
    )
    wide = mindformers_yaml(tmp_path / "wide.yaml", reference.config, tokenizer_dir, False)
    wide.write_text(wide.read_text().replace("intermediate_size: 128", "intermediate_size: 96"))
    case("shape", weights, r"feed_forward\.w1\.weight is \[128, 64\] in the checkpoint but \[96, 64\]", wide)
    bias = dict(weights, **{"model.layers.0.attention.wq.bias": np.zeros(64, np.float32)})
    case("extra", bias, "model.layers.0.attention.wq.bias is not in the model")
    mha = mindformers_yaml(tmp_path / "mha.yaml", reference.config, tokenizer_dir, True)
    mha.write_text(mha.read_text().replace("n_kv_heads: 2", "n_kv_heads: 4"))
    fused = mindspore_weights(reference, fused=True)
    case("fused_shape", fused, r"w_qkv\.weight is \[128, 64\], but the model_config describes \[192, 64\]", mha)
    no_tok = mindformers_yaml(tmp_path / "notok.yaml", reference.config, None, False)
    cases["no_tokenizer"] = (["--config", str(no_tok), unknown], "processor.tokenizer names no tokenizer")
    cases["folder"] = (["--config", str(config), str(Path(missing).parent)], "a folder: pass the consolidated .ckpt")
    cases["no_config"] = ([missing], "pass --config MF_YAML")

    sharded = tmp_path / "sharded"
    for r in range(2):
        (sharded / f"rank_{r}").mkdir(parents=True)
        save_ms(weights, sharded / f"rank_{r}" / f"checkpoint_{r}.ckpt")
    (sharded / "strategy.ckpt").write_bytes(b"\x08\x01")
    hint = r"a sharded MindSpore checkpoint .*mindspore\.transform_checkpoints"
    cases["sharded_dir"] = (["--config", str(config), str(sharded)], hint)
    cases["one_rank"] = (["--config", str(config), str(sharded / "rank_1" / "checkpoint_1.ckpt")], hint)
    cases["strategy"] = (["--config", str(config), str(sharded / "strategy.ckpt")], "a parallel strategy file")

    good = save_ms(weights, tmp_path / "good.ckpt", crc_check=True)
    data = good.read_bytes()
    (tmp_path / "truncated.ckpt").write_bytes(data[: len(data) // 2])
    cases["truncated"] = (["--config", str(config), str(tmp_path / "truncated.ckpt")], "not a MindSpore checkpoint")
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    (tmp_path / "flipped.ckpt").write_bytes(bytes(flipped))
    cases["crc"] = (["--config", str(config), str(tmp_path / "flipped.ckpt")], "CRC-32 .* does not match")
    return cases


def test_bad_inputs_are_one_line_exit_2_and_write_nothing(tmp_path, tokenizer_dir, capsys):
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    cases = _bad_inputs(tmp_path, tokenizer_dir)
    for name, (args, message) in cases.items():
        before = checksums(tmp_path)
        capsys.readouterr()
        *flags, src = args
        assert main(["import", src, *flags, "--output", str(tmp_path / f"out_{name}")]) == 2, name
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and re.search(message, err), (name, err)
        assert checksums(tmp_path) == before, name
        assert not list(tmp_path.glob(f"out_{name}*")), name
    good = tmp_path / "good.ckpt"
    assert main(["import", str(good), "--config", str(tmp_path / "run.yaml"), "--output", str(existing)]) == 2
    assert "already exists" in capsys.readouterr().err and (existing / "keep.txt").read_text() == "mine"
