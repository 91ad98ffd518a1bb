"""The dataset directory both masked-token preprocessors write (data/sft.py, data/preference.py): the tokenizer
with its config and chat template, per split the token file, its loss mask and its offsets, and meta.json last,
moved into place whole (data/preprocess.py `publish_with_meta`)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np

from meshformer.data.chat import load_chat_template
from meshformer.data.preprocess import publish_with_meta
from meshformer.data.tokenizer import load_tokenizer, special_token_ids, vocab_size


def open_tokenizer(tokenizer: str | Path, template: str | None, needs_template: bool = True):
    """(tokenizer with padding and truncation off, its directory, its tokenizer_config.json or {}, the chat template
    or None when neither named nor needed)."""
    tok_dir = Path(tokenizer) if Path(tokenizer).is_dir() else Path(tokenizer).parent
    tok = load_tokenizer(tokenizer)
    tok.no_padding()
    tok.no_truncation()
    cfg_file = tok_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text(encoding="utf-8")) if cfg_file.is_file() else {}
    chat = load_chat_template(tok_dir, template) if (template or needs_template) else None
    return tok, tok_dir, cfg, chat


def tokenizer_meta(tok, tok_dir: Path, tok_bytes: bytes) -> tuple[dict, np.dtype]:
    """(meta.json's tokenizer keys, the token files' dtype: uint16 when the vocabulary fits)."""
    ids_special, vocab = special_token_ids(tok, tok_dir), vocab_size(tok)
    dtype = np.dtype("<u2") if vocab <= 1 << 16 else np.dtype("<u4")
    meta = {
        "dtype": dtype.name,
        "tokenizer_hash": hashlib.sha256(tok_bytes).hexdigest(),
        "vocab_size": vocab,
        "eos_token_id": ids_special["eos"],
        "bos_token_id": ids_special["bos"],
        "pad_token_id": ids_special["pad"],
    }
    return meta, dtype


def write_split(d: Path, split: str, data: dict, dtype) -> dict:
    """{split}.bin (tokens), {split}.mask.bin (uint8, 1 = a target) and {split}.idx.npy (offsets, n + 1) of the
    split's `data["ids"]` and `data["masks"]`."""
    ids, masks = data["ids"], data["masks"]
    flat = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
    (d / f"{split}.bin").write_bytes(flat.astype(dtype).tobytes())
    (d / f"{split}.mask.bin").write_bytes((np.concatenate(masks) if masks else np.zeros(0, np.uint8)).tobytes())
    offsets = np.zeros(len(ids) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(x) for x in ids])
    np.save(d / f"{split}.idx.npy", offsets, allow_pickle=False)
    return {"tokens": int(flat.shape[0]), "documents": len(ids), "samples": len(ids)}


def publish_dataset(
    out: Path, meta: dict, splits: dict, dtype, tokenizer_files: tuple, published: tuple, write=write_split
) -> dict:
    """Write the dataset in a temporary directory beside `out` and move it into place; returns the meta written.
    `splits`: {split: its data}, each written by `write(tmp, split, data, dtype)`, which returns its meta;
    `tokenizer_files`: (tokenizer.json's bytes, tokenizer_config.json's dict, the chat template or None);
    `published`: (input paths, overwrite, the paths --overwrite must never delete), as `publish_with_meta` takes
    them."""
    tok_bytes, tok_cfg, chat = tokenizer_files
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        meta = {**meta, "splits": {split: write(tmp, split, data, dtype) for split, data in splits.items()}}
        (tmp / "tokenizer.json").write_bytes(tok_bytes)
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=1), encoding="utf-8")
        if chat is not None:
            (tmp / "chat_template.jinja").write_text(chat, encoding="utf-8")
        return publish_with_meta(tmp, out, meta, *published)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
