"""`meshformer template check DIR [--data DATASET]`: will this chat template train and serve the way you think?

The seed's tip for a fine-tune whose loss will not fall is to encode and decode the template and look for
unknown tokens. This automates it, on sample conversations rendered with DIR's template and tokenizer:
- the text round-trips (decode(encode(text)) == text) and holds no unknown token;
- every marker the template writes (`<|im_start|>`, `<|eot_id|>`, `</s>`, `[INST]`, ...) that looks special is one
  token of the vocabulary, not split into pieces (a base model's tokenizer missing the chat tokens);
- every assistant reply ends with an end-of-turn or EOS token (else the model never learns to stop);
- earlier turns render the same when later turns are added (else training text differs from serving text);
- BOS is not doubled (a template that writes it while the tokenizer adds it again).
With `--data`, the held-out conversations of an instruction dataset are re-rendered and re-tokenized with DIR's
template and tokenizer and must give exactly the stored tokens and loss mask: train/serve agreement, checked.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from meshformer.data.chat import load_chat_template, template_tokens
from meshformer.data.documents import iter_records
from meshformer.data.sft import encode_sample, to_messages
from meshformer.data.tokenizer import load_tokenizer
from meshformer.errors import UserError

SAMPLES = [
    [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "Paris."}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "And a number, with ünïcödé and 12345?"},
        {"role": "assistant", "content": "Seven."},
    ],
]
MARKER = re.compile(r"<\|[^|<>\s]{1,40}\|>|</?s>|\[/?INST\]|<</?SYS>>")
END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "</s>", "<|endoftext|>", "<|end_of_text|>")


def check_template(directory: str | Path, template_name: str | None = None) -> list[str]:
    """Problems found (empty: the template is sound for this tokenizer)."""
    d = Path(directory)
    tok = load_tokenizer(d)
    tok.no_padding()
    tok.no_truncation()
    cfg_file = d / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_file.read_text(encoding="utf-8")) if cfg_file.is_file() else {}
    template = load_chat_template(d, template_name)
    specials = template_tokens(tok_cfg)
    added = {t.content for t in tok.get_added_tokens_decoder().values()}
    problems: list[str] = []
    for messages in SAMPLES:
        try:
            ids, mask, text, spans, _ = encode_sample(tok, template, messages, specials, False, "sample conversation")
        except UserError as e:
            problems.append(str(e))
            continue
        back = tok.decode(ids.tolist(), skip_special_tokens=False)
        if back != text:
            problems.append(f"decode(encode(text)) differs from the rendered text: {back[:60]!r} vs {text[:60]!r}")
        unk = tok.token_to_id(specials.get("unk_token") or "") if specials.get("unk_token") else None
        if unk is not None and int((ids == unk).sum()):
            problems.append(f"{int((ids == unk).sum())} unknown token(s) in a rendered conversation")
        for marker in sorted(set(MARKER.findall(text))):
            pieces = tok.encode(marker, add_special_tokens=False).ids
            if len(pieces) != 1 or marker not in added:
                problems.append(
                    f"the template writes {marker!r} but the tokenizer encodes it as {len(pieces)} piece(s)"
                    f"{'' if marker in added else ', not as a special token'}: the model cannot tell it from text"
                )
        for a, b in spans:
            reply = text[a:b].rstrip()
            if not any(reply.endswith(t) for t in (*END_TOKENS, specials.get("eos_token") or "\0")):
                problems.append(f"an assistant reply ends without an end-of-turn or EOS token ({reply[-20:]!r})")
        bos = specials.get("bos_token")
        if bos and text.startswith(bos) and tok.encode("x").ids[:1] == [tok.token_to_id(bos)]:
            problems.append(f"BOS {bos!r} twice: the template writes it and the tokenizer adds it again")
    return sorted(set(problems))


def check_dataset(directory: str | Path, dataset: str | Path) -> tuple[int, list[str]]:
    """(held-out samples compared, problems): each must re-encode, with DIR's template and tokenizer, to exactly
    the tokens and loss mask stored in the dataset."""
    d, ds = Path(directory), Path(dataset)
    from meshformer.data.dataset import load_offsets, map_array, read_meta  # torch: only for --data

    meta = read_meta(ds, "--data")
    if meta.get("format") != "meshformer-sft-v1":
        raise UserError(f"--data {ds}: not an instruction dataset made by `meshformer preprocess` (meta.json)")
    tok = load_tokenizer(d)
    tok.no_padding()
    tok.no_truncation()
    cfg_file = d / "tokenizer_config.json"
    specials = template_tokens(json.loads(cfg_file.read_text(encoding="utf-8")) if cfg_file.is_file() else {})
    template = load_chat_template(d)
    problems = []
    stored = ds / "chat_template.jinja"
    if not stored.is_file() or template != stored.read_text(encoding="utf-8", errors="replace"):
        problems.append(f"{d}'s chat template is not the one {ds} was made with")
    if (
        not (ds / "tokenizer.json").is_file()
        or (d / "tokenizer.json").read_bytes() != (ds / "tokenizer.json").read_bytes()
    ):
        problems.append(f"{d}'s tokenizer.json is not the one {ds} was made with")
    dtype = np.dtype(meta["dtype"]).newbyteorder("<")
    info = meta["splits"].get("validation") or {}
    count, samples = info.get("tokens", 0), info.get("samples", 0)
    if not isinstance(samples, int) or isinstance(samples, bool) or samples < 0:
        raise UserError(
            f"--data {ds}: meta.json's splits.validation.samples={samples!r} is not a count: re-run preprocess"
        )
    tokens = map_array(ds / "validation.bin", dtype, count, "tokens")
    masks = map_array(ds / "validation.mask.bin", np.dtype(np.uint8), count, "mask bytes")
    offsets = load_offsets(ds / "validation.idx.npy", samples, count)
    held_out = meta.get("validation_lines", [])
    sources = [Path(s["path"]) for s in meta.get("sources", []) if isinstance(s, dict) and "path" in s]
    if (
        not isinstance(samples, int)
        or len(held_out) != samples
        or any(
            not (isinstance(x, list) and len(x) == 2 and isinstance(x[0], int) and 0 <= x[0] < len(sources))
            for x in held_out
        )
    ):
        raise UserError(f"--data {ds}: meta.json's validation_lines or sources are damaged: re-run preprocess")
    records: dict[Path, dict] = {}  # path -> {line number (JSONL) or index (JSON array): (where, record)}
    n = 0
    for i, (file_index, key) in enumerate(held_out):
        path = sources[file_index]
        if path not in records:
            records[path] = {k: (where, rec) for where, k, rec in iter_records(path)} if path.is_file() else {}
        if key not in records[path] or not isinstance(records[path][key][1], dict):
            problems.append(f"{path}: record {key}, held out in {ds}, is gone: the source changed since preprocess")
            continue
        where, record = records[path][key]
        messages = to_messages(record, meta.get("format_detected") or "messages", where)
        ids, mask, _, _, _ = encode_sample(tok, template, messages, specials, meta.get("train_on_prompt", False), where)
        keep = len(ids) if meta.get("overlong") == "drop" else min(len(ids), meta["seq_length"] + 1)
        a, b = int(offsets[i]), int(offsets[i + 1])
        if not (np.array_equal(ids[:keep], tokens[a:b].astype(np.int64)) and np.array_equal(mask[:keep], masks[a:b])):
            problems.append(f"{where}: renders to other tokens or another loss mask than the dataset stored")
        n += 1
    return n, problems
