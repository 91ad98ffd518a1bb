"""Read a llama.cpp GGUF file into a `SourceModel` (Hugging Face names, shapes, config and tokenizer).

A GGUF holds the same model as a Hugging Face checkpoint, but written the way llama.cpp wants it:

- Shapes are stored in ggml's `ne` order, fastest-moving dimension first, i.e. reversed from torch. A linear
  layer's `[out_features, in_features]` appears as `[in_features, out_features]`; we reverse it back.
- Most weights are block-quantized (Q8_0, Q4_0, Q4_1, K-quants, ...). We dequantize to float32 with the
  `gguf` package's own reference code (`gguf.quants.dequantize`), so the values are exactly what llama.cpp's
  Python tooling reads; a type it cannot decode is reported rather than guessed.
- Tensor names are llama.cpp's; the model family that owns the GGUF architecture (models/registry.py; the Llama
  family's tables are models/llama/gguf.py) says what each is in Hugging Face terms.
- For some architectures (`llama`) llama.cpp's converter permutes the rows of q_proj and k_proj so that the rotary
  embedding rotates adjacent pairs (GPT-J style) instead of the two halves of each head (GPT-NeoX style, what
  `transformers` uses); the family's table says so, and we undo that permutation. Qwen2/Qwen3 files are written
  unpermuted (llama.cpp runs them with NeoX rotary), so they are left alone.
- Llama 3 long-context rope scaling is stored as a tensor of per-frequency factors (`rope_freqs.weight`)
  rather than as config values; we turn it back into a `rope_scaling` dict and check that it reproduces them.
- There is no config.json or tokenizer.json: both are rebuilt from metadata. The tokenizer is built the way
  `transformers` builds it for `from_pretrained(..., gguf_file=...)` so both encode text to the same ids.

The `gguf` package is imported lazily: it is only needed when a GGUF file is actually read.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from meshformer.errors import UserError
from meshformer.interop.source import SourceModel

# The split regexes `transformers` puts in front of byte-level BPE for these `tokenizer.ggml.pre` values
# (transformers/integrations/gguf/gguf_tokenizer_mapping.py); any other value keeps GPT-2's built-in regex.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx", "pixtral"], _LLAMA3_SPLIT),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "megrez"], _QWEN2_SPLIT),
}

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token_type values


def read_gguf(path: str | Path) -> SourceModel:
    """Read a GGUF file (a registered family's architecture: llama, qwen2, qwen3 built in; byte-level BPE tokenizer)
    as a Hugging Face model."""
    try:
        import gguf
    except ImportError:
        raise UserError(f"{path}: reading GGUF files needs the 'gguf' package (pip install gguf)") from None
    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, ValueError, IndexError, KeyError) as e:  # what a missing, foreign or truncated file raises
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"{path}: cannot read as GGUF: {reason}") from None
    meta = {name: field.contents() for name, field in reader.fields.items()}

    from meshformer.models.registry import family_for_gguf, gguf_architectures

    arch = meta.get("general.architecture")
    found = family_for_gguf(arch) if isinstance(arch, str) else None
    if found is None:
        supported = ", ".join(gguf_architectures())
        raise UserError(f"{path}: GGUF architecture {arch!r} is not supported ({supported} are)")
    names = found[1]

    config = _config(meta, arch, names, {t.name for t in reader.tensors}, path)
    if names.read_config is not None:
        config.update(names.read_config(meta, config))
    # Map every name before dequantizing anything, so a file we cannot convert fails in a second, not a minute.
    hf_names = {t.name: _hf_name(t.name, arch, names, path) for t in reader.tensors if t.name != "rope_freqs.weight"}
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        values = _dequantize(gguf, t, path)
        if t.name == "rope_freqs.weight":
            # Not a weight: llama3 rope factors, which transformers computes from config.rope_scaling.
            config["rope_scaling"] = _llama3_rope_scaling(meta, arch, config, values, path)
            continue
        name = hf_names[t.name]
        if names.permute_rotary and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            if values.shape[0] % (2 * heads):
                raise UserError(f"{path}: {t.name} has {values.shape[0]} rows, not a multiple of 2 x {heads} heads")
            values = _unpermute_rotary(values, heads)
        if names.norm_shift and t.name.endswith("norm.weight"):  # the stored factor back to the model's weight
            values = (values.double() - names.norm_shift).float()
        tensors[name] = values

    tokenizer_json, tokenizer_config = _tokenizer(meta, path)
    return SourceModel(config, tensors, tokenizer_json, tokenizer_config, origin=str(path))


def _dequantize(gguf, tensor, path) -> torch.Tensor:
    """Float32 values of one GGUF tensor, in Hugging Face (torch) shape order."""
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        kind = tensor.tensor_type.name
        raise UserError(f"{path}: tensor {tensor.name} is stored as {kind}, which gguf cannot dequantize") from None
    shape = [int(n) for n in reversed(tensor.shape)]  # ne order -> torch order
    # np.array copies: the reader's arrays are read-only views into a memory map of the file.
    return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(shape)


def _hf_name(name: str, arch: str, names, path) -> str:
    if name in names.global_names:
        return names.global_names[name]
    prefix, _, rest = name.partition(".")
    layer, _, part = rest.partition(".")
    if prefix == "blk" and layer.isdigit() and part in names.layer_parts:
        return f"model.layers.{int(layer)}.{names.layer_parts[part]}"
    raise UserError(f"{path}: GGUF tensor {name!r} has no Hugging Face equivalent for architecture {arch!r}")


def _unpermute_rotary(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's `permute(w, n_head)`, which interleaves the two rotary halves of every head.

    llama.cpp: `w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)`; swapping the
    same two axes of the transposed view restores the original row order.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def _config(meta: dict, arch: str, names, tensor_names: set[str], path) -> dict:
    missing = object()

    def key(name, default=missing):
        value = meta.get(f"{arch}.{name}", default)
        if value is missing:
            raise UserError(f"{path}: GGUF metadata lacks '{arch}.{name}'")
        if isinstance(value, list):  # per-layer values (e.g. varying kv heads) do not fit a Llama/Qwen config
            raise UserError(f"{path}: GGUF metadata '{arch}.{name}' varies per layer, which is not supported")
        return value

    hf_class, model_type = names.hf_class, names.model_type
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    tokens = meta.get("tokenizer.ggml.tokens") or []
    scaling_type = key("rope.scaling.type", "none")
    rope_scaling = None
    if scaling_type in ("linear", "yarn"):
        rope_scaling = {"rope_type": scaling_type, "factor": float(key("rope.scaling.factor"))}
        if scaling_type == "yarn":
            rope_scaling["original_max_position_embeddings"] = int(key("rope.scaling.original_context_length"))
    elif scaling_type != "none":
        raise UserError(f"{path}: GGUF rope scaling type {scaling_type!r} is not supported (linear, yarn are)")
    head_dim = int(key("attention.key_length", hidden // heads))
    rotary = {}
    if names.rotary_fraction_key is not None:  # the rotary turns rope.dimension_count channels of each head
        rotary[names.rotary_fraction_key] = int(key("rope.dimension_count")) / head_dim
    return {
        **rotary,
        "architectures": [hf_class],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length")),
        "vocab_size": int(key("vocab_size", len(tokens))),
        # llama.cpp writes output.weight only when it differs from the embedding matrix.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_act": "silu",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "rope_scaling": rope_scaling,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,  # q/k/v biases (Qwen2's always)
    }


def _llama3_rope_scaling(meta: dict, arch: str, config: dict, factors: torch.Tensor, path) -> dict:
    """The llama3 `rope_scaling` dict behind a `rope_freqs.weight` tensor.

    llama.cpp's converter computes the factors from factor, low/high_freq_factor and the original context
    (8192 unless stated) and stores only the result. Metadata gives at most factor and original context, so
    the rest take Llama 3.1's values; recomputing the factors checks that guess instead of trusting it.
    """
    factor = float(meta.get(f"{arch}.rope.scaling.factor", factors.max().item()))
    old_context = int(meta.get(f"{arch}.rope.scaling.original_context_length", 8192))
    low, high = 1.0, 4.0  # low_freq_factor, high_freq_factor
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": old_context,
    }
    dim, base = config["head_dim"], config["rope_theta"]
    expected = []
    for i in range(0, dim, 2):  # llama.cpp's convert_hf_to_gguf.py, LlamaModel.generate_extra_tensors
        wavelen = 2 * math.pi * base ** (i / dim)
        smooth = (old_context / wavelen - low) / (high - low)
        if wavelen < old_context / high:
            expected.append(1.0)
        elif wavelen > old_context / low:
            expected.append(factor)
        else:
            expected.append(1 / ((1 - smooth) / factor + smooth))
    if factors.shape != (dim // 2,) or not torch.allclose(factors, torch.tensor(expected), rtol=1e-4):
        raise UserError(f"{path}: rope_freqs.weight does not match llama3 rope scaling {scaling}")
    return scaling


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the alphabet byte-level BPE vocabularies are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]  # spelled as chr(256), chr(257), ... in byte order
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


def _tokenizer(meta: dict, path) -> tuple[str, dict]:
    """(tokenizer.json text, tokenizer_config dict), built as transformers builds a GGUF's byte-level BPE."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise UserError(f"{path}: GGUF tokenizer model {model!r} is not supported (only 'gpt2' byte-level BPE is)")
    tokens = meta["tokenizer.ggml.tokens"]
    token_types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = meta.get("tokenizer.ggml.merges")
    if not merges:
        raise UserError(f"{path}: GGUF tokenizer has no 'tokenizer.ggml.merges'")

    # A real byte-level token is spelled in the byte alphabet; llama.cpp writes a few (e.g. ones holding a plain
    # space) as text, which transformers respells byte by byte. The same goes here, so the vocabularies agree.
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(tokens)
    }
    bpe = BPE(
        vocab=vocab,
        merges=[tuple(merge.split(" ")) for merge in merges],
        dropout=None,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
    )
    tokenizer = Tokenizer(bpe)
    split = _PRE_TOKENIZER_SPLITS.get(meta.get("tokenizer.ggml.pre"))
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()

    # Control tokens (<|im_start|>, ...) must match whole, as special tokens; a "control" token outside the byte
    # alphabet is a llama.cpp mislabel, which transformers skips. User-defined ones (<think>) match whole too.
    kinds = list(zip(tokens, token_types))
    tokenizer.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t, kind in kinds if kind == _CONTROL and set(t) <= alphabet]
    )
    tokenizer.add_tokens(
        [AddedToken(t, normalized=False, special=False) for t, kind in kinds if kind == _USER_DEFINED and t in vocab]
    )

    config: dict = {}
    for name, key in [("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")]:
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        config[f"{name}_token"] = tokens[token_id] if token_id is not None and token_id < len(tokens) else None
    # transformers registers the named special tokens as special added tokens too.
    named = [t for t in (config[f"{n}_token"] for n in ("bos", "eos", "unk", "pad")) if t is not None]
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in named])

    # BOS/EOS insertion on encode, as transformers' update_post_processor writes it.
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and config["bos_token"] is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and config["eos_token"] is not None
    bos, eos = config["bos_token"], config["eos_token"]
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    special = [(bos, tokenizer.token_to_id(bos))] if add_bos else []
    special += [(eos, tokenizer.token_to_id(eos))] if add_eos else []
    tokenizer.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)

    config["add_bos_token"], config["add_eos_token"] = add_bos, add_eos
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return tokenizer.to_str(), config
