"""Write a Hugging Face-style model (config, tensors, tokenizer) as a llama.cpp GGUF file: the inverse of gguf_read.

What changes on the way, as llama.cpp's own `convert_hf_to_gguf.py` does it:

- Names become llama.cpp's (`blk.0.attn_q.weight`, `token_embd.weight`, ...), the inverse of the model family's
  GGUF table (models/registry.py; models/llama/gguf.py).
- For the `llama` architecture (the family's table says which) q_proj/k_proj rows are permuted so llama.cpp's
  GPT-J style rotary (adjacent pairs) computes what transformers' NeoX style (two halves per head) does.
  Qwen2/Qwen3 run NeoX rotary in llama.cpp, so their rows stay as they are.
- Llama 3 rope scaling becomes a `rope_freqs.weight` tensor of per-frequency factors; llama.cpp has no config
  value for it.
- Weights are stored as F32, F16, BF16 or Q8_0. 1-D tensors (norms, biases) stay F32, as llama.cpp keeps them:
  they are tiny and quantizing them costs accuracy for nothing. A matrix whose rows do not split into Q8_0
  blocks falls back to F16, again as llama.cpp does.
- There is no tokenizer.json in a GGUF: a byte-level BPE tokenizer becomes the `tokenizer.ggml.*` metadata
  (tokens, token types, merges, special ids) plus `tokenizer.ggml.pre`, which names the text-splitting regex.

`gguf.GGUFWriter` takes numpy arrays in torch (row-major) order and writes ggml's reversed `ne` order itself;
quantized data goes in as the uint8 array `gguf.quants.quantize` returns, with `raw_dtype` saying what it is.
The file is written next to the target and renamed into place, so a failure never leaves a partial GGUF.

llama.cpp reads everything written here. `transformers` (`from_pretrained(dir, gguf_file=...)`) does not read
`rope_freqs.weight`, nor Qwen3's head_count_kv / key_length / rms epsilon: such files load there only with the
model's config passed as `config=`.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import numpy as np
import torch

from meshformer.errors import UserError
from meshformer.interop.gguf_read import _LLAMA3_SPLIT, _QWEN2_SPLIT

# qtype -> llama.cpp's file type (general.file_type), by name since gguf is imported lazily
_FILE_TYPES = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q8_0": "MOSTLY_Q8_0"}
_NORMAL, _CONTROL, _USER_DEFINED, _UNUSED = 1, 3, 4, 5  # llama.cpp's token_type values


def write_gguf(
    path: str | Path,
    config: dict,
    tensors: dict[str, torch.Tensor],
    tokenizer_json: str,
    tokenizer_config: dict,
    qtype: str = "F16",
) -> Path:
    """Write a Llama / Qwen2 / Qwen3 model with a byte-level BPE tokenizer to `path` as GGUF; returns the path."""
    try:
        import gguf
    except ImportError:
        raise UserError("writing GGUF files needs the 'gguf' package (pip install gguf)") from None

    path = Path(path)
    qtype = qtype.upper()
    if qtype not in _FILE_TYPES:
        raise UserError(f"GGUF type {qtype!r} is not supported (choose one of {', '.join(_FILE_TYPES)})")
    arch, table = _arch(config)
    rope_keys = ("rope_scaling", "rope_parameters")  # an architecture with its own metadata writes its scaling
    hp = _hyperparameters(
        {k: v for k, v in config.items() if k not in rope_keys} if table.write_metadata else config,
        arch,
        table.rotary_fraction_key,
    )
    hp["permute_rotary"] = table.permute_rotary
    # Everything that can be refused is checked before the file is opened.
    vocab = _vocabulary(tokenizer_json, tokenizer_config, config, hp["vocab_size"])
    names = _gguf_names(config, tensors, arch, table, hp)

    tmp = path.with_name(path.name + ".tmp")
    try:
        writer = gguf.GGUFWriter(str(tmp), arch)  # also writes general.architecture
        writer.add_name(path.stem)
        writer.add_context_length(hp["context"])
        writer.add_embedding_length(hp["hidden"])
        writer.add_block_count(hp["layers"])
        writer.add_feed_forward_length(hp["ffn"])
        writer.add_head_count(hp["heads"])
        writer.add_head_count_kv(hp["kv_heads"])
        writer.add_key_length(hp["head_dim"])
        writer.add_value_length(hp["head_dim"])
        # transformers reads llama's head_dim from this key; llama.cpp turns this many channels of each head
        writer.add_rope_dimension_count(hp["rope_dims"])
        writer.add_layer_norm_rms_eps(hp["eps"])
        writer.add_rope_freq_base(hp["theta"])
        writer.add_vocab_size(hp["vocab_size"])
        writer.add_file_type(getattr(gguf.LlamaFileType, _FILE_TYPES[qtype]))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        if hp["llama3"]:
            # Only for gguf_read to rebuild rope_scaling; llama.cpp reads it for YaRN only. The factor is not
            # written: llama.cpp would take rope.scaling.factor for a linear scale on top of the factors.
            writer.add_rope_scaling_orig_ctx_len(int(hp["llama3"].get("original_max_position_embeddings", 8192)))
            writer.add_tensor("rope_freqs.weight", _llama3_rope_factors(hp["llama3"], hp["head_dim"], hp["theta"]))
        if table.write_metadata is not None:
            table.write_metadata(writer, gguf, config)
        _add_tokenizer(writer, vocab)
        # One float32 copy at a time; the writer keeps the encoded data until write_tensors_to_file.
        for name, hf_name in names.items():
            values = tensors[hf_name].detach().to(device="cpu", dtype=torch.float32).numpy()
            if heads := _rotary_heads(name, arch, hp):
                values = _permute_rotary(values, heads)
            if table.norm_shift and name.endswith("norm.weight"):
                values = (values.astype(np.float64) + table.norm_shift).astype(np.float32)
            data, raw_dtype = _encode(gguf, values, qtype)
            writer.add_tensor(name, data, raw_dtype=raw_dtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _arch(config: dict):
    """(GGUF architecture, its family's name table) of a config.json's architecture class."""
    from meshformer.models.registry import families, family_for_hf_class

    for hf_class in config.get("architectures") or []:
        found = family_for_hf_class(hf_class)
        if found is not None:
            family, arch = found
            return arch, family.gguf_names[arch]
    named = (config.get("architectures") or ["none given"])[0]
    known = [t.hf_class for f in families() for t in f.gguf_names.values()]
    raise UserError(f"GGUF export: architecture {named!r} is not supported ({', '.join(known)} are)")


def _hyperparameters(config: dict, arch: str, rotary_fraction_key: str | None = None) -> dict:
    def need(key):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"GGUF export: config.json lacks a number for {key!r}")
        return value

    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    # rope_theta + rope_scaling (what hf_config writes) or transformers 5's rope_parameters
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("default", "llama3") or (kind == "llama3" and arch != "llama"):
        raise UserError(f"GGUF export: rope scaling {kind!r} is not supported for {arch} (llama3 on llama is)")
    head_dim = int(config.get("head_dim") or hidden // heads)
    rope_dims = head_dim
    if rotary_fraction_key is not None:  # a rotary over the first fraction of each head (top level or rope_parameters)
        fraction = config.get(rotary_fraction_key, scaling.get(rotary_fraction_key))
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise UserError(f"GGUF export: config.json needs {rotary_fraction_key} in (0, 1] for {arch}: {fraction!r}")
        rope_dims = int(head_dim * fraction)
    return {
        "hidden": hidden,
        "heads": heads,
        "kv_heads": int(config.get("num_key_value_heads") or heads),
        "head_dim": head_dim,
        "rope_dims": rope_dims,
        "layers": int(need("num_hidden_layers")),
        "ffn": int(need("intermediate_size")),
        "eps": float(config.get("rms_norm_eps", 1e-6)),
        "theta": float(config.get("rope_theta", scaling.get("rope_theta", 10000.0))),
        "llama3": scaling if kind == "llama3" else None,
        "context": int(need("max_position_embeddings")),
        "vocab_size": int(need("vocab_size")),
    }


def _gguf_names(config: dict, tensors: dict[str, torch.Tensor], arch: str, table, hp: dict) -> dict[str, str]:
    """llama.cpp name -> Hugging Face name of every tensor to write; refuses what llama.cpp could not load."""
    global_names = {hf: name for name, hf in table.global_names.items()}
    layer_parts = {hf: part for part, hf in table.layer_parts.items()}
    tied = bool(config.get("tie_word_embeddings", False))
    if not tied and "lm_head.weight" not in tensors:
        raise UserError("GGUF export: tie_word_embeddings is false but there is no lm_head.weight")
    embedding = tensors.get("model.embed_tokens.weight")
    if embedding is None or embedding.shape[0] != hp["vocab_size"]:  # llama.cpp wants one token per row
        raise UserError(f"GGUF export: model.embed_tokens.weight missing or not {hp['vocab_size']} (vocab_size) rows")

    names = {}
    for hf_name, tensor in tensors.items():
        if hf_name == "lm_head.weight" and tied:
            continue  # llama.cpp writes output.weight only when it differs from the embedding
        match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_name)
        if hf_name in global_names:
            name = global_names[hf_name]
        elif match and match[2] in layer_parts:
            name = f"blk.{int(match[1])}.{layer_parts[match[2]]}"
        else:
            raise UserError(f"GGUF export: tensor {hf_name!r} has no llama.cpp name for architecture {arch!r}")
        heads = _rotary_heads(name, arch, hp)
        if heads and tensor.shape[0] % (2 * heads):
            raise UserError(f"GGUF export: {hf_name} has {tensor.shape[0]} rows, not a multiple of 2 x {heads}")
        names[name] = hf_name
    return names


def _rotary_heads(name: str, arch: str, hp: dict) -> int | None:
    """The head count to permute a q/k matrix by (architectures whose table permutes rotary rows: llama); None for
    every other tensor."""
    if not hp["permute_rotary"] or not name.endswith(("attn_q.weight", "attn_k.weight")):
        return None
    return hp["heads"] if name.endswith("attn_q.weight") else hp["kv_heads"]


def _permute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: interleave each head's two rotary halves (undone by gguf_read)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_factors(scaling: dict, dim: int, base: float) -> np.ndarray:
    """llama.cpp's `LlamaModel.generate_extra_tensors`: the factor each rotary frequency is divided by."""
    factor = float(scaling.get("factor", 8.0))
    low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling.get("original_max_position_embeddings", 8192))
    factors = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * base ** (i / dim)
        if wavelen < old_context / high:
            factors.append(1.0)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _encode(gguf, values: np.ndarray, qtype: str):
    """(array for GGUFWriter.add_tensor, raw_dtype) for one tensor stored as `qtype`."""
    Q = gguf.GGMLQuantizationType
    if values.ndim <= 1 or qtype == "F32":
        return values.astype(np.float32), None
    if qtype == "Q8_0" and values.shape[-1] % gguf.GGML_QUANT_SIZES[Q.Q8_0][0]:
        qtype = "F16"  # rows that do not split into 32-value blocks: llama.cpp's fallback
    if qtype == "F16":
        return values.astype(np.float16), None
    # BF16 and Q8_0 come back as raw bytes; add_tensor turns the byte shape back into the element shape.
    return gguf.quants.quantize(values, Q[qtype]), Q[qtype]


def _vocabulary(tokenizer_json: str, tokenizer_config: dict, config: dict, vocab_size: int) -> dict:
    """The `tokenizer.ggml.*` values for a byte-level BPE tokenizer.json, as llama.cpp's converter derives them."""
    try:
        tok = json.loads(tokenizer_json)
        model = tok["model"]
    except (TypeError, ValueError, KeyError):
        raise UserError("GGUF export: the tokenizer is not a tokenizer.json") from None
    if model.get("type") != "BPE":
        raise UserError(f"GGUF export: tokenizer model {model.get('type')!r} is not supported (byte-level BPE is)")
    pre = _pre_tokenizer_name(tok.get("pre_tokenizer"))
    normalizer = (tok.get("normalizer") or {}).get("type")
    if normalizer not in (None, "NFC"):  # llama.cpp applies none; NFC (Qwen) only matters for unnormalized text
        raise UserError(f"GGUF export: tokenizer normalizer {normalizer!r} is not supported (llama.cpp has none)")

    id_to_token = {index: token for token, index in model["vocab"].items()}
    types = dict.fromkeys(id_to_token, _NORMAL)
    for added in tok.get("added_tokens") or []:
        id_to_token[added["id"]] = added["content"]
        types[added["id"]] = _CONTROL if added.get("special") else _USER_DEFINED
    if max(id_to_token, default=-1) >= vocab_size:
        raise UserError(f"GGUF export: tokenizer has ids up to {max(id_to_token)}, the model only {vocab_size} rows")
    # llama.cpp wants one token per embedding row: the rows no token uses get placeholder names.
    tokens = [id_to_token.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    token_types = [types.get(i, _UNUSED) for i in range(vocab_size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]

    token_ids = {token: i for i, token in enumerate(tokens)}
    special = {}
    for kind in ("bos", "eos", "unk", "pad"):
        # As llama.cpp's SpecialVocab: tokenizer_config.json's token first, config.json's id otherwise.
        token = tokenizer_config.get(f"{kind}_token")
        token = token.get("content") if isinstance(token, dict) else token
        token_id = token_ids.get(token) if isinstance(token, str) else None
        if token_id is None:
            token_id = config.get(f"{kind}_token_id")
            token_id = token_id[0] if isinstance(token_id, list) and token_id else token_id
        if isinstance(token_id, int) and 0 <= token_id < vocab_size:
            special[kind] = token_id

    adds = dict(zip(("bos", "eos"), _template_adds(tok.get("post_processor"))))
    for kind in adds:  # tokenizer_config.json has the last word, as in llama.cpp
        if isinstance(tokenizer_config.get(f"add_{kind}_token"), bool):
            adds[kind] = tokenizer_config[f"add_{kind}_token"]
    chat = tokenizer_config.get("chat_template")
    return dict(pre=pre, tokens=tokens, types=token_types, merges=merges, special=special, adds=adds, chat=chat)


def _pre_tokenizer_name(pre: dict | None) -> str:
    """llama.cpp's `tokenizer.ggml.pre` for the splitting a tokenizer.json does; refuse what it cannot name."""
    pre = pre or {}
    steps = [s or {} for s in pre.get("pretokenizers") or []] if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    if not kinds or kinds[-1] != "ByteLevel" or steps[-1].get("add_prefix_space"):
        raise UserError("GGUF export: only byte-level BPE tokenizers (ByteLevel pre-tokenizer, no prefix space) work")
    byte_level_regex = steps[-1].get("use_regex", True)
    if kinds == ["ByteLevel"] and byte_level_regex:
        return "gpt-2"  # GPT-2's regex, built into ByteLevel: meshformer's own tokenizer
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and byte_level_regex:
        return "smollm"  # single digits, then GPT-2's regex (SmolLM, StarCoder)
    if kinds == ["Split", "ByteLevel"] and not byte_level_regex:
        pattern = (steps[0].get("pattern") or {}).get("Regex")
        names = {_LLAMA3_SPLIT: "llama-bpe", _QWEN2_SPLIT: "qwen2"}
        if pattern in names and steps[0].get("behavior") == "Isolated" and not steps[0].get("invert"):
            return names[pattern]
    raise UserError(f"GGUF export: pre-tokenizer {' + '.join(map(str, kinds))} has no llama.cpp equivalent")


def _template_adds(post: dict | None) -> tuple[bool, bool]:
    """(adds BOS, adds EOS) for a tokenizer.json post-processor, as llama.cpp's SpecialVocab reads it."""
    post = post or {}
    steps = post.get("processors", []) if post.get("type") == "Sequence" else [post]
    for step in steps:
        single = step.get("single") if step.get("type") == "TemplateProcessing" else None
        if single:
            return "SpecialToken" in single[0], "SpecialToken" in single[-1]
    return False, False


def _add_tokenizer(writer, vocab: dict) -> None:
    writer.add_tokenizer_model("gpt2")  # llama.cpp's name for byte-level BPE
    writer.add_tokenizer_pre(vocab["pre"])
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["types"])
    writer.add_token_merges(vocab["merges"])
    for kind, token_id in vocab["special"].items():
        getattr(writer, f"add_{kind}_token_id")(token_id)  # add_bos_token_id, ..., add_pad_token_id
    writer.add_add_bos_token(vocab["adds"]["bos"])
    writer.add_add_eos_token(vocab["adds"]["eos"])
    if vocab["chat"]:
        writer.add_chat_template(vocab["chat"])
