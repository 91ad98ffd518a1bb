"""Instruction data for supervised fine-tuning: conversations rendered with the model's chat template, a loss mask
that keeps only what the assistant says, written as a dataset the trainer reads (format meshformer-sft-v1).

Inputs are JSONL (one sample per line) or JSON arrays of samples (.json, LLaMA-Factory's files; data/documents.py
`iter_records`), in one of three shapes (detected from the fields, `--format` forces one):
  alpaca    {"instruction", "input" (optional), "output", "system" (optional),
             "history" (optional: [[user, assistant], ...], earlier turns, as LLaMA-Factory reads it)}
  messages  {"messages": [{"role": "system"|"user"|"assistant", "content"}, ...]}   (OpenAI style, multi-turn)
  sharegpt  {"conversations": [{"from": "system"|"human"|"gpt", "value"}, ...], "system" (optional)}
Every text is a string: content that is null, a number or an object is refused with its record's line (FILE:LINE)
or array element (FILE[i]). OpenAI-style content parts, [{"type": "text", "text": ...}, ...], all of them text, are
joined with newlines (as vLLM does for text-only models); any other part (an image) is refused.

The mask comes from the template itself: for every assistant turn k, the conversation up to k rendered with the
generation prompt must be a prefix of the conversation through turn k; the characters between the two are the
assistant's, including the template's end-of-turn token (<|im_end|>, <|eot_id|>, </s>), so the model learns to
stop. A template that renders earlier turns differently once later turns are added is refused: training and
serving would then see different text. Tokens whose characters are the assistant's count toward the loss
(`train_on_prompt` counts every token). Samples are kept whole, one per row; the trainer pads each to
seq_length + 1 (pad labels ignored), so no sample ever attends to another.

Directory: meta.json, tokenizer.json, tokenizer_config.json, chat_template.jinja, and per split
{split}.bin (tokens), {split}.mask.bin (uint8, 1 = this token is a target) and {split}.idx.npy (offsets, n + 1).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.markup import escape

from meshformer.data.chat import render_chat, template_tokens
from meshformer.data.documents import iter_records, json_type
from meshformer.data.masked_output import open_tokenizer, publish_dataset, tokenizer_meta
from meshformer.data.preprocess import prepare_output
from meshformer.errors import UserError

FORMAT = "meshformer-sft-v1"
FORMATS = ("alpaca", "messages", "sharegpt")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


def detect_format(record: dict, where: str) -> str:
    if "messages" in record:
        return "messages"
    if "conversations" in record:
        return "sharegpt"
    if "instruction" in record and "output" in record:
        return "alpaca"
    raise UserError(
        f"{where}: cannot tell the format from the fields {sorted(record)[:6]}: expected 'messages', "
        f"'conversations' or 'instruction' + 'output' (or pass --format)"
    )


def _text(value, where: str, what: str, optional: bool = False) -> str:
    """`value` as the text of a turn: a string, or OpenAI-style text parts joined with newlines."""
    if isinstance(value, str):
        return value
    if optional and value is None:
        return ""
    if isinstance(value, list) and value and all(isinstance(v, dict) and v.get("type") == "text" for v in value):
        if all(isinstance(v.get("text"), str) for v in value):
            return "\n".join(v["text"] for v in value)
    kind = "an array, not all of it text parts" if isinstance(value, list) and value else json_type(value)
    raise UserError(
        f"{where}: {what} is {kind}, not a string: give every turn's text as a string "
        f'(or a list of {{"type": "text", "text": ...}} parts)'
    )


def to_messages(record: dict, fmt: str, where: str) -> list[dict]:
    if fmt == "alpaca":
        if "instruction" not in record or "output" not in record:
            raise UserError(
                f"{where}: an alpaca record needs 'instruction' and 'output' (fields: {sorted(record)[:6]})"
            )
        user = _text(record["instruction"], where, "'instruction'")
        extra = _text(record.get("input"), where, "'input'", optional=True)
        if extra:
            user = f"{user}\n\n{extra}"
        system = _text(record.get("system"), where, "'system'", optional=True)
        msgs = [{"role": "system", "content": system}] if system else []
        history = record.get("history") or []
        if not isinstance(history, list) or not all(isinstance(h, list) and len(h) == 2 for h in history):
            raise UserError(f"{where}: 'history' must be a list of [user, assistant] pairs")
        for k, (q, a) in enumerate(history):
            msgs.append({"role": "user", "content": _text(q, where, f"history[{k}][0]")})
            msgs.append({"role": "assistant", "content": _text(a, where, f"history[{k}][1]")})
        output = _text(record["output"], where, "'output'")
        return [*msgs, {"role": "user", "content": user}, {"role": "assistant", "content": output}]
    key, role_key, text_key = (
        ("messages", "role", "content") if fmt == "messages" else ("conversations", "from", "value")
    )
    turns = record.get(key)
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        raise UserError(f"{where}: {key!r} must be a list of objects")
    out = []
    system = record.get("system") if fmt == "sharegpt" else None
    if system is not None and not (turns and turns[0].get(role_key) == "system"):
        out.append({"role": "system", "content": _text(system, where, "'system'")})
    for k, t in enumerate(turns):
        role = str(t.get(role_key, ""))
        role = SHAREGPT_ROLES.get(role, role) if fmt == "sharegpt" else role
        if role not in ("system", "user", "assistant"):
            raise UserError(f"{where}: unknown role {t.get(role_key)!r} (system, user, assistant)")
        if text_key not in t:
            raise UserError(f"{where}: {key}[{k}] ({role}) has no {text_key!r}: every turn needs its text")
        out.append({"role": role, "content": _text(t[text_key], where, f"{key}[{k}].{text_key} ({role})")})
    return out


def assistant_spans(template: str, messages: list[dict], specials: dict, where: str) -> tuple[str, list[tuple]]:
    """(the rendered conversation, [(start, end) character span of every assistant turn])."""
    full = render_chat(template, messages, **specials)
    spans = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render_chat(template, messages[:k], add_generation_prompt=True, **specials)
        through = render_chat(template, messages[: k + 1], **specials)
        if not through.startswith(before) or not full.startswith(through):
            raise UserError(
                f"{where}: the chat template renders turn {k} differently once later turns are added, so the "
                f"assistant's tokens cannot be told apart (and training would not match serving): fix the template"
            )
        if len(through) == len(before):
            raise UserError(
                f"{where}: the chat template renders nothing for assistant turns (it has no assistant role): "
                f"use a template that renders them (--template chatml, llama3 or llama2)"
            )
        spans.append((len(before), len(through)))
    if not spans:
        raise UserError(f"{where}: no assistant turn: a fine-tuning sample needs at least one reply to learn")
    return full, spans


def encode_sample(tok, template: str, messages: list[dict], specials: dict, train_on_prompt: bool, where: str):
    """(token ids, mask: 1 for tokens the loss counts, the rendered text, the assistant spans in it, the character
    offset where each token starts)."""
    text, spans = assistant_spans(template, messages, specials, where)
    enc = tok.encode(text, add_special_tokens=False)
    ids = np.asarray(enc.ids, dtype=np.int64)
    mask = np.zeros(len(ids), dtype=np.uint8)
    for i, (a, b) in enumerate(enc.offsets):
        if train_on_prompt or any(s <= a and b <= e and a < b for s, e in spans):
            mask[i] = 1
    return ids, mask, text, spans, [a for a, _ in enc.offsets]


@dataclass(frozen=True)
class _SampleRules:
    """How records become samples: the format, the template and its tokens, what the loss counts, the length."""

    fmt: str | None
    chat_template: str
    specials: object
    train_on_prompt: bool
    seq_length: int
    overlong: str
    every: int  # every n-th kept sample goes to validation (0: none)


def _collect_samples(paths: list, tok, rules: _SampleRules) -> tuple[dict, dict, tuple | None]:
    """(the samples of each split with their loss masks and source lines, the report's counts, a first example)."""
    splits = {s: {"ids": [], "masks": [], "lines": []} for s in ("train", "validation")}
    report = {"samples": 0, "truncated": 0, "dropped": 0, "tokens": 0, "target_tokens": 0, "by_role": {}}
    example = None
    for file_index, path in enumerate(paths):
        for where, n, record in iter_records(path):
            if not isinstance(record, dict):
                raise UserError(f"{where}: a JSON {json_type(record)}: each record must be a JSON object")
            messages = to_messages(record, rules.fmt or detect_format(record, where), where)
            ids, mask, _, _, starts = encode_sample(
                tok, rules.chat_template, messages, rules.specials, rules.train_on_prompt, where
            )
            _count_roles(report, starts, messages, rules.chat_template, rules.specials, mask)
            if len(ids) > rules.seq_length + 1:
                if rules.overlong == "drop":
                    report["dropped"] += 1
                    continue
                ids, mask = ids[: rules.seq_length + 1], mask[: rules.seq_length + 1]
                report["truncated"] += 1
            if example is None:
                example = (tok, ids, mask)
            split = "validation" if rules.every and report["samples"] % rules.every == rules.every - 1 else "train"
            splits[split]["ids"].append(ids)
            splits[split]["masks"].append(mask)
            splits[split]["lines"].append([file_index, n])  # where it came from (`template check --data`)
            report["samples"] += 1
            report["tokens"] += len(ids)
            report["target_tokens"] += int(mask.sum())
    return splits, report, example


def preprocess_sft(
    inputs: list,
    tokenizer: str | Path,
    output: str | Path,
    *,
    fmt: str | None = None,
    template: str | None = None,
    seq_length: int = 2048,
    overlong: str = "truncate",
    train_on_prompt: bool = False,
    val_fraction: float = 0.05,
    overwrite: bool = False,
    console: Console | None = None,
) -> dict:
    t0 = time.perf_counter()
    console = console or Console()
    if fmt is not None and fmt not in FORMATS:
        raise UserError(f"--format {fmt!r}: one of {', '.join(FORMATS)}")
    paths, out, keep = prepare_output(inputs, tokenizer, output, val_fraction, overwrite, console)
    tok, tok_dir, tok_cfg, chat_template = open_tokenizer(tokenizer, template)
    tok_bytes = (tok_dir / "tokenizer.json").read_bytes()
    specials = template_tokens(tok_cfg)
    tok_keys, dtype = tokenizer_meta(tok, tok_dir, tok_bytes)
    every = round(1 / val_fraction) if val_fraction > 0 else 0

    rules = _SampleRules(fmt, chat_template, specials, train_on_prompt, seq_length, overlong, every)
    splits, report, example = _collect_samples(paths, tok, rules)
    if not splits["train"]["ids"]:
        raise UserError(f"--input: no usable samples in {', '.join(map(str, paths))}")

    meta = {
        "format": FORMAT,
        **tok_keys,
        "seq_length": seq_length,
        "train_on_prompt": train_on_prompt,
        "report": report,
        "format_detected": fmt,
        "template_name": template,
        "overlong": overlong,
        "validation_lines": splits["validation"]["lines"],
    }
    meta = publish_dataset(out, meta, splits, dtype, (tok_bytes, tok_cfg, chat_template), (paths, overwrite, keep))
    summary = {**meta, "output": str(out), "seconds": round(time.perf_counter() - t0, 3)}
    _print_report(console, summary, example)
    return summary


def _count_roles(report, starts, messages, template, specials, mask) -> None:
    """Per-role token counts (for the mask report): a token belongs to the turn its characters start in."""
    bounds = [len(render_chat(template, messages[: k + 1], **specials)) for k in range(len(messages))]
    for a, m in zip(starts, mask):
        k = next((i for i, b in enumerate(bounds) if a < b), len(messages) - 1)
        role = messages[k]["role"]
        counts = report["by_role"].setdefault(role, {"tokens": 0, "target_tokens": 0})
        counts["tokens"] += 1
        counts["target_tokens"] += int(m)


def _print_report(console: Console, s: dict, example) -> None:
    r = s["report"]
    p = lambda text: console.print(text, soft_wrap=True)  # noqa: E731
    p(f"[bold]wrote {escape(s['output'])}[/bold] in {s['seconds']:.2f}s (instruction data, {FORMAT})")
    tr, va = s["splits"]["train"], s["splits"]["validation"]
    p(
        f"  samples     {r['samples']} kept ({tr['samples']} train, {va['samples']} validation); "
        f"{r['truncated']} truncated and {r['dropped']} dropped at seq_length {s['seq_length']}"
    )
    share = r["target_tokens"] / max(r["tokens"], 1)
    p(f"  loss mask   {r['target_tokens']:,} of {r['tokens']:,} tokens count toward the loss ({share:.1%})")
    for role, c in sorted(r["by_role"].items()):
        p(f"    {role:<10} {c['tokens']:>8,} tokens, {c['target_tokens'] / max(c['tokens'], 1):6.1%} trained")
    if example is not None:
        tok, ids, mask = example
        parts = []
        for t, m in zip(ids.tolist(), mask.tolist()):
            piece = escape(tok.decode([t], skip_special_tokens=False))
            parts.append(f"[bold green]{piece}[/bold green]" if m else f"[dim]{piece}[/dim]")
        p("  first sample (trained tokens in green):")
        p("    " + "".join(parts).replace("\n", "\n    "))
