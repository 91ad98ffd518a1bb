"""`write_gguf`: tiny random transformers models written as GGUF in every qtype, read back two independent ways.

`read_gguf` (our reader) must give back the config and tensors; `transformers`' own GGUF loader must compute the
same logits as the original model and its GGUF tokenizer must encode text to the same ids as the original
tokenizers.Tokenizer. Five models cover Llama untied and tied, Llama 3 rope scaling, Qwen2 (q/k/v biases, an
intermediate size whose rows do not split into Q8_0 blocks) and Qwen3 (q/k norms, head_dim 32 != hidden/heads).
"""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch

from meshformer.errors import UserError
from meshformer.interop.gguf_read import _LLAMA3_SPLIT, _QWEN2_SPLIT, read_gguf
from meshformer.interop.gguf_write import write_gguf

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
TOKENIZER_CONFIG = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE}
CORPUS = [
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "The user said hi to the assistant, and the assistant said hello back.",
    "I'm sure they'll see what we've done with 12 apples and 345 pears.",
] * 4
TEXTS = [
    "Hello world, the quick brown fox!",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "  two spaces\tand a tab\n\nnew lines, I'm sure they'll",
    "numbers 12345 and émojis 🙂",
]

BASE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "max_position_embeddings": 256,
    "vocab_size": 512,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 2,
    "pad_token_id": None,
}
LLAMA3 = {  # a short original context, so the scaling changes positions 0..15 measurably
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
# case -> (model_type, config changes, tokenizer pre-splitting, whether the tokenizer adds BOS)
CASES = {
    "llama": ("llama", {}, "gpt-2", False),
    "llama_tied": ("llama", {"tie_word_embeddings": True}, "gpt-2", True),
    "llama3_rope": ("llama", {"rope_scaling": LLAMA3, "rope_theta": 10000.0}, "llama-bpe", False),
    "qwen2": ("qwen2", {"intermediate_size": 136, "vocab_size": 520, "rope_theta": 1e6}, "qwen2", False),
    "qwen3": ("qwen3", {"head_dim": 32, "tie_word_embeddings": True}, "gpt-2", False),
}
CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
QTYPES = ["F32", "F16", "BF16", "Q8_0"]
LOGIT_TOL = {"F32": 1e-4, "F16": 1e-2, "BF16": 5e-2, "Q8_0": 5e-2}
# transformers' GGUF config mapping knows no llama3 rope_freqs and no Qwen3 head_count_kv / key_length / rms eps,
# so for these the original config is passed in and only weights and tokenizer come from the file.
CONFIG_FROM_ORIGINAL = {"llama3_rope", "qwen3"}


def train_tokenizer(pre: str, add_bos: bool):
    """A ~300-token byte-level BPE with the three chat special tokens, split as llama.cpp's `pre` names."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    if pre == "gpt-2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        split = {"llama-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}[pre]
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    if pre == "gpt-2" and not add_bos:  # exactly meshformer's own tokenizer (data/tokenizer.py)
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<|endoftext|> $A", pair="<|endoftext|> $A <|endoftext|> $B", special_tokens=[("<|endoftext|>", 0)]
        )
    return tok


@functools.cache
def build(case: str):
    """(Hugging Face config dict, transformers model, tokenizer) for one case; built once per session."""
    model_type, changes, pre, add_bos = CASES[case]
    hf = {"architectures": [CLASSES[model_type]], "model_type": model_type, **BASE, **changes}
    config = transformers.AutoConfig.for_model(**copy.deepcopy(hf))  # it edits nested dicts in place
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # spread the weights: a tiny init would hide permutation or naming mistakes
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return hf, model, train_tokenizer(pre, add_bos)


def llama_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's converter (`LlamaModel.permute`)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hf_tensors(hf: dict, model) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    if hf["tie_word_embeddings"]:
        del state["lm_head.weight"]
    return state


def check_stored_types(path, hf: dict, qtype: str) -> None:
    """1-D tensors stay F32; matrices take qtype, Q8_0 falling back to F16 for rows not in 32-value blocks."""
    for t in gguf.GGUFReader(str(path)).tensors:
        expected = qtype
        if len(t.shape) == 1:
            expected = "F32"
        elif qtype == "Q8_0" and int(t.shape[0]) % 32:  # shape is ne order: row length first
            expected = "F16"
        assert t.tensor_type.name == expected, (t.name, t.tensor_type.name)
    if qtype == "Q8_0" and hf["intermediate_size"] % 32:
        reader = gguf.GGUFReader(str(path))
        assert {t.name: t.tensor_type.name for t in reader.tensors}["blk.0.ffn_down.weight"] == "F16"


def check_read_back(path, hf: dict, tensors: dict[str, torch.Tensor], qtype: str) -> None:
    src = read_gguf(path)
    c = src.config
    for key in ["architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]:
        assert c[key] == hf[key], key
    for key in ["num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size", "tie_word_embeddings"]:
        assert c[key] == hf[key], key
    assert (c["bos_token_id"], c["eos_token_id"], c["pad_token_id"]) == (0, 2, None)
    assert c["rms_norm_eps"] == pytest.approx(hf["rms_norm_eps"]) and c["rope_theta"] == hf["rope_theta"]
    assert c["rope_scaling"] == hf["rope_scaling"]
    assert src.tokenizer_config["chat_template"] == CHAT_TEMPLATE

    assert set(src.tensors) == set(tensors)
    for name, original in tensors.items():
        ours = src.tensors[name]
        assert ours.shape == original.shape, name
        if qtype == "F32" or original.dim() == 1:
            assert torch.equal(ours, original), name
        elif qtype == "F16":
            torch.testing.assert_close(ours, original, rtol=1e-3, atol=1e-6, msg=name)
        elif qtype == "BF16":
            torch.testing.assert_close(ours, original, rtol=4e-3, atol=1e-6, msg=name)
        else:  # Q8_0: half a step of an 8-bit code scaled to the block maximum (plus F16 rounding of the scale)
            assert (ours - original).abs().max() <= original.abs().max() / 127, name


def check_rotary_layout(path, hf: dict, tensors: dict[str, torch.Tensor]) -> None:
    """In the file, llama q/k rows are in llama.cpp's interleaved order; Qwen's are as transformers has them."""
    stored = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    for part, heads in [("q", hf["num_attention_heads"]), ("k", hf["num_key_value_heads"])]:
        original = tensors[f"model.layers.1.self_attn.{part}_proj.weight"]
        raw = torch.from_numpy(np.array(stored[f"blk.1.attn_{part}.weight"].data)).reshape(original.shape)
        expected = llama_permute(original, heads) if hf["model_type"] == "llama" else original
        assert torch.equal(raw, expected), part
        if hf["model_type"] == "llama":  # and the permutation is not the identity for these shapes
            assert not torch.equal(raw, original), part


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_write_read_and_transformers(case, qtype, tmp_path):
    hf, model, tok = build(case)
    tensors = hf_tensors(hf, model)
    name = f"{case}-{qtype}.gguf"
    path = write_gguf(tmp_path / name, hf, tensors, tok.to_str(), TOKENIZER_CONFIG, qtype)
    assert path == tmp_path / name and sorted(p.name for p in tmp_path.iterdir()) == [name]

    check_stored_types(path, hf, qtype)
    check_read_back(path, hf, tensors, qtype)
    if qtype == "F32":
        check_rotary_layout(path, hf, tensors)

    extra = {"config": model.config} if case in CONFIG_FROM_ORIGINAL else {}
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=name, dtype=torch.float32, **extra
    ).eval()
    if not extra:  # the config came from our metadata
        assert loaded.config.num_key_value_heads == hf["num_key_value_heads"]
        assert loaded.config.tie_word_embeddings == hf["tie_word_embeddings"]
    ids = torch.randint(0, hf["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (loaded(ids).logits - model(ids).logits).abs().max().item()
    print(f"{case} {qtype}: max |logit difference| = {diff:.2e}")
    assert diff <= LOGIT_TOL[qtype], (case, qtype, diff)

    if qtype == "F32":  # the tokenizer is the same in every qtype: check it once per case
        theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=name)
        for text in TEXTS:
            assert theirs(text)["input_ids"] == tok.encode(text).ids, text
        assert (tok.encode("Hi").ids[0] == 0) is CASES[case][3]  # BOS added or not, as the original does
        assert theirs.chat_template == CHAT_TEMPLATE


def write_tiny(path, qtype="F16", tokenizer_json=None):
    hf, model, tok = build("llama_tied")
    tokenizer_json = tok.to_str() if tokenizer_json is None else tokenizer_json
    return write_gguf(path, hf, hf_tensors(hf, model), tokenizer_json, TOKENIZER_CONFIG, qtype)


def test_a_rotary_over_part_of_each_head_is_its_rope_dimension_count():
    """An architecture whose table names a rotary-fraction key writes llama.cpp's rope.dimension_count as
    int(head_dim x fraction), from the top level or rope_parameters; a missing or bad fraction is one line."""
    from meshformer.interop.gguf_write import _hyperparameters

    hf = {**BASE, "num_attention_heads": 4, "hidden_size": 64, "head_dim": 24}
    assert _hyperparameters(hf, "llama")["rope_dims"] == 24  # no key: the whole head
    assert _hyperparameters({**hf, "turned": 0.75}, "x", "turned")["rope_dims"] == 18
    assert _hyperparameters({**hf, "rope_parameters": {"turned": 0.5}}, "x", "turned")["rope_dims"] == 12
    for bad in (None, 0, 1.5, True):
        with pytest.raises(UserError, match="turned in \\(0, 1\\]"):
            _hyperparameters({**hf, "turned": bad}, "x", "turned")


def test_unknown_qtype(tmp_path):
    with pytest.raises(UserError, match="'Q4_K' is not supported") as err:
        write_tiny(tmp_path / "m.gguf", qtype="Q4_K")
    assert "\n" not in str(err.value) and list(tmp_path.iterdir()) == []


def test_non_byte_level_tokenizers_are_refused(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    word_level = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    metaspace_bpe = Tokenizer(models.BPE({"a": 0, "▁": 1}, []))
    metaspace_bpe.pre_tokenizer = pre_tokenizers.Metaspace()
    for tok, message in [(word_level, "'WordLevel' is not supported"), (metaspace_bpe, "only byte-level BPE")]:
        with pytest.raises(UserError, match=message) as err:
            write_tiny(tmp_path / "m.gguf", tokenizer_json=tok.to_str())
        assert "\n" not in str(err.value) and list(tmp_path.iterdir()) == []


def test_failed_write_leaves_no_partial_file(tmp_path, monkeypatch):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"the previous export")

    def fail(self, *args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", fail)
    with pytest.raises(OSError, match="disk full"):
        write_tiny(path)
    assert path.read_bytes() == b"the previous export" and sorted(tmp_path.iterdir()) == [path]


def test_an_architecture_may_shift_its_norms_and_write_its_own_metadata(tmp_path, monkeypatch):
    """GgufArch.norm_shift is added to every stored `*norm.weight` and taken off on read (within float32's 2**-23
    of w + 1; every other tensor bit for bit); write_metadata / read_config carry the architecture's own keys."""
    from dataclasses import replace

    from meshformer.models.registry import family_for_gguf

    family, table = family_for_gguf("qwen3")

    def write_metadata(writer, gguf_module, config):
        writer.add_sliding_window(7)

    def read_config(meta, config):
        return {"sliding_window": int(meta["qwen3.attention.sliding_window"])}

    shifted = replace(table, norm_shift=1.0, write_metadata=write_metadata, read_config=read_config)
    monkeypatch.setitem(family.gguf_names, "qwen3", shifted)
    hf, model, tok = build("qwen3")
    tensors = {name: t.clone() for name, t in hf_tensors(hf, model).items()}  # build() keeps its model for others
    with torch.no_grad():  # norms away from 1, so that the shift is not exact
        for name, t in tensors.items():
            if name.endswith("norm.weight"):
                t.add_(torch.randn(t.shape, generator=torch.Generator().manual_seed(0)) * 0.1)
    path = write_gguf(tmp_path / "q.gguf", hf, tensors, tok.to_str(), TOKENIZER_CONFIG, "F32")
    stored = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    raw = torch.from_numpy(np.array(stored["blk.0.attn_norm.weight"].data))
    assert torch.equal(raw, (tensors["model.layers.0.input_layernorm.weight"].double() + 1).float())
    src = read_gguf(path)
    assert src.config["sliding_window"] == 7
    norms = [n for n in tensors if n.endswith("norm.weight")]
    assert len(norms) == 1 + 4 * hf["num_hidden_layers"]
    for name, original in tensors.items():
        if name in norms:
            assert (src.tensors[name] - original).abs().max() <= 2**-23, name
        else:
            assert torch.equal(src.tensors[name], original), name
