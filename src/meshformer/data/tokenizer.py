"""Training and loading byte-level BPE tokenizers (the `tokenizers` library's tokenizer.json format).

The trained tokenizer is GPT-2 style: a ByteLevel pre-tokenizer maps every byte to a printable symbol before
BPE, and the ByteLevel decoder maps them back, with no normalizer, so decode(encode(text)) == text for any text
and no input is ever <unk>. Its special tokens take the first ids:

    0 <|endoftext|>   end of document (EOS) and beginning of sequence (BOS)
    1 <|pad|>         padding
    2 <|im_start|>    chat turn start (fine-tuning)
    3 <|im_end|>      chat turn end

Foreign tokenizer.json files (Llama, Qwen, Mistral...) load too; `special_token_ids` finds their BOS/EOS/pad.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from meshformer.data.chat import BUILTIN
from meshformer.data.documents import iter_documents, resolve_inputs
from meshformer.errors import UserError

EOS = "<|endoftext|>"
PAD = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS, PAD, IM_START, IM_END)
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)  # every byte plus the special tokens, before any merge
MAX_VOCAB = 1 << 22  # far above any real BPE vocabulary; catches a typo'd extra zero or two

# Candidates for foreign tokenizers, most specific first. EOS prefers the *document* end token over chat-turn
# ends: Qwen has both <|endoftext|> and <|im_end|>, Llama 3 both <|end_of_text|> and <|eot_id|>, and packing
# pre-training documents wants the former.
_EOS_CANDIDATES = (
    "<|endoftext|>",
    "<|end_of_text|>",
    "</s>",
    "<eos>",
    "<|eos|>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|end|>",
)
_BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "<|bos|>", "<|startoftext|>")
_PAD_CANDIDATES = ("<|pad|>", "<pad>", "<|finetune_right_pad_id|>", "[PAD]", "<|padding|>")


def _tokenizer_file(path: str | Path, field: str) -> Path:
    p = Path(path)
    f = p / "tokenizer.json" if p.is_dir() else p
    if not f.is_file():
        raise UserError(
            f"{field}={str(path)!r}: no tokenizer.json there: create one with "
            f"`meshformer tokenizer train --input FILES --vocab-size N --output DIR`"
        )
    return f


def load_tokenizer(path: str | Path, field: str = "--tokenizer") -> Tokenizer:
    """A directory holding tokenizer.json, or the file itself."""
    f = _tokenizer_file(path, field)
    try:
        return Tokenizer.from_file(str(f))
    except Exception as e:  # the Rust side raises a bare Exception for bad JSON or an unknown model
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(
            f"{field}={str(path)!r}: {f} is not a valid tokenizer.json ({first}): "
            f"re-create it with `meshformer tokenizer train`"
        ) from None


def tokenizer_hash(path: str | Path, field: str = "--tokenizer") -> str:
    """sha256 hex of the tokenizer.json bytes: a dataset records it so training can refuse a different tokenizer."""
    return hashlib.sha256(_tokenizer_file(path, field).read_bytes()).hexdigest()


def vocab_size(tok: Tokenizer) -> int:
    """One past the largest id (not the token count): foreign added tokens may leave holes in the id range."""
    return max(tok.get_vocab(with_added_tokens=True).values()) + 1


def _config_token(cfg: dict, key: str) -> str | None:
    v = cfg.get(key)
    if isinstance(v, dict):  # transformers writes AddedToken objects as {"content": ..., ...}
        v = v.get("content")
    return v if isinstance(v, str) else None


def special_token_ids(tok: Tokenizer, path: str | Path | None = None) -> dict:
    """{"bos": id, "eos": id, "pad": id}; eos is required, bos and pad fall back to it.

    `path` (the tokenizer's directory or file) lets a transformers tokenizer_config.json next to the file
    name the tokens explicitly, which beats guessing by name.
    """
    named: dict[str, str | None] = {}
    if path is not None:
        p = Path(path)
        cfg_file = (p if p.is_dir() else p.parent) / "tokenizer_config.json"
        if cfg_file.is_file():
            try:
                cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError):
                cfg = {}
            if isinstance(cfg, dict):
                named = {k: _config_token(cfg, f"{k}_token") for k in ("bos", "eos", "pad")}

    def find(kind: str, candidates: tuple[str, ...]) -> int | None:
        for name in (named.get(kind), *candidates):
            if name is not None and (i := tok.token_to_id(name)) is not None:
                return i
        return None

    eos = find("eos", _EOS_CANDIDATES)
    if eos is None:
        raise UserError(
            f"the tokenizer has no end-of-text token (looked for {', '.join(_EOS_CANDIDATES)}): "
            f"use one made by `meshformer tokenizer train`, or add `eos_token` to its "
            f"tokenizer_config.json"
        )
    bos = find("bos", _BOS_CANDIDATES)
    pad = find("pad", _PAD_CANDIDATES)
    if pad is None and tok.padding is not None:
        pad = tok.padding.get("pad_id")
    return {"bos": eos if bos is None else bos, "eos": eos, "pad": eos if pad is None else pad}


def _new_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # add_prefix_space=False: a leading space would be invented on encode and survive decode, breaking round trips.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)  # offsets only; adds no tokens
    return tok


def _hf_config() -> dict:
    """tokenizer_config.json so `transformers.AutoTokenizer.from_pretrained(DIR)` gets the special tokens."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "additional_special_tokens": [IM_START, IM_END],
        "chat_template": BUILTIN["chatml"],  # the turn markers above are ChatML's
    }


def train_tokenizer(
    files: list[str],
    vocab_size: int,
    output_dir: str | Path,
    overwrite: bool = False,
    text_field: str = "text",
    show_progress: bool | None = None,
) -> Path:
    """Train a byte-level BPE of `vocab_size` ids (special tokens included) and write output_dir/tokenizer.json.

    Inputs are read like `meshformer preprocess` reads them (.txt whole files, .jsonl `text_field`), so a
    tokenizer never learns JSON syntax. A small corpus may support fewer merges: the vocabulary is then smaller
    than asked (see `vocab_size(load_tokenizer(...))`).
    """
    if not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise UserError(
            f"--vocab-size={vocab_size}: must be between {MIN_VOCAB} (256 bytes + "
            f"{len(SPECIAL_TOKENS)} special tokens) and {MAX_VOCAB}; 2048-8192 suits a small corpus, "
            f"32000-128000 a large one"
        )
    paths = resolve_inputs(files)
    out = Path(output_dir)
    target = out / "tokenizer.json"
    if out.exists() and not out.is_dir():
        raise UserError(f"--output={str(out)!r} is a file: give a directory")
    if target.exists() and not overwrite:
        raise UserError(
            f"--output={str(out)!r} already holds a tokenizer.json: pass --overwrite to replace it, "
            f"or choose another directory"
        )

    if show_progress is None:
        show_progress = sys.stderr.isatty()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,  # a pair seen once is noise, not a reusable piece
        special_tokens=list(SPECIAL_TOKENS),  # listed first, so they get ids 0..3
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, even those absent from the corpus
        show_progress=show_progress,
    )
    tok = _new_tokenizer()
    chars = 0

    def docs():
        nonlocal chars
        for _, doc in iter_documents(paths, text_field=text_field):
            chars += len(doc.strip())
            yield doc

    tok.train_from_iterator(docs(), trainer=trainer)
    if chars == 0:
        raise UserError(f"--input: no text in {', '.join(map(str, paths))}: give files with text in them")

    out.mkdir(parents=True, exist_ok=True)
    # Write beside the target and rename, so an interrupted run never leaves a truncated tokenizer.json.
    tmp = out / f".tokenizer.json.tmp-{os.getpid()}"
    try:
        tok.save(str(tmp))
        cfg_tmp = out / f".tokenizer_config.json.tmp-{os.getpid()}"
        cfg_tmp.write_text(json.dumps(_hf_config(), indent=2) + "\n", encoding="utf-8")
        os.replace(cfg_tmp, out / "tokenizer_config.json")
        os.replace(tmp, target)
    finally:
        for t in out.glob(f".*.tmp-{os.getpid()}"):
            t.unlink(missing_ok=True)
    return target
