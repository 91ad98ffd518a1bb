"""Preference data for DPO, ORPO, SimPO (pairs) and KTO (unpaired examples): records (data/preference_records.py)
tokenized exactly as TRL 1.16 does, so the same file gives TRL's token ids, written as a dataset the trainer reads
(format meshformer-preference-v1, data/preference_dataset.py).

Tokenization (trl/trainer/dpo_trainer.py and kto_trainer.py `_prepare_dataset`):
  - standard (text) records: EOS is appended to each completion as text unless it already ends with it; prompt,
    prompt+chosen and prompt+rejected are each encoded with the tokenizer's special tokens (a BOS it adds);
  - conversational records: the prompt is rendered with the generation prompt, prompt+completion as one
    conversation, both encoded without special tokens (the template writes them);
  - the completion starts where the prompt's ids and prompt+completion's ids first differ (for a pair, the earlier
    of the two), which absorbs templates that render a lone prompt differently and BPE merges across the boundary;
  - `max_length` cuts each sequence, keeping its start (`truncation_mode: keep_start`, TRL's default) or its end
    (`keep_end`); with keep_start (and always for KTO, as TRL) a pair whose prompt alone fills max_length is
    dropped: no completion token would be left.
Counted in the report: pairs kept, sequences cut, pairs dropped for their prompt, pairs whose chosen and rejected
are the same text (kept, as TRL keeps them: their DPO gradient is zero), desirable/undesirable KTO examples.

Directory: meta.json ("kind": "pairs" or "unpaired"), tokenizer files, and per split {split}.bin (tokens),
{split}.mask.bin (1 = completion token), {split}.idx.npy (sequence offsets; a pair is sequences 2k, 2k+1: chosen,
rejected) and, for KTO, {split}.label.bin (uint8, 1 = desirable).
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.markup import escape

from meshformer.data.chat import render_chat, template_tokens
from meshformer.data.documents import iter_records, json_type
from meshformer.data.masked_output import open_tokenizer, publish_dataset, tokenizer_meta, write_split
from meshformer.data.preference_records import KINDS, detect_kind, to_pair, to_unpaired
from meshformer.data.preprocess import prepare_output
from meshformer.errors import UserError

FORMAT = "meshformer-preference-v1"
TRUNCATION_MODES = ("keep_start", "keep_end")
DEFAULT_MAX_LENGTH = 1024  # TRL 1.16 DPOConfig.max_length


class Encoder:
    """TRL's `_tokenize` for one tokenizer and template: text with special tokens, conversations rendered."""

    def __init__(self, tok, template: str | None, specials: dict):
        self.tok, self.template, self.specials = tok, template, specials
        self.eos = specials.get("eos_token") or ""

    def ids(self, value, add_generation_prompt: bool = False) -> list[int]:
        if isinstance(value, str):
            return self.tok.encode(value, add_special_tokens=True).ids
        if self.template is None:
            raise UserError("conversational preference records need a chat template: pass --template")
        text = render_chat(self.template, value, add_generation_prompt=add_generation_prompt, **self.specials)
        return self.tok.encode(text, add_special_tokens=False).ids

    def with_eos(self, completion):
        """TRL's add_eos: standard completions end with the EOS text; conversations are left to the template."""
        if isinstance(completion, str) and self.eos and not completion.endswith(self.eos):
            return completion + self.eos
        return completion

    def split(self, prompt, completions: list) -> tuple[list[int], list[list[int]]]:
        """(prompt ids, [completion ids]) cut where the prompt's ids and each prompt+completion's ids diverge."""
        prompt_ids = self.ids(prompt, add_generation_prompt=not isinstance(prompt, str))
        full = [self.ids(prompt + self.with_eos(c)) for c in completions]
        cut = min(common_prefix_length(prompt_ids, f) for f in full)
        return prompt_ids[:cut], [f[cut:] for f in full]


def common_prefix_length(ids: list[int], other: list[int]) -> int:
    n = 0
    for a, b in zip(ids, other):
        if a != b:
            break
        n += 1
    return n


def truncate(ids: list[int], mask: list[int], max_length: int | None, mode: str) -> tuple[list, list, bool]:
    """TRL DataCollatorForPreference's cut of one sequence: (ids, mask, whether it was cut)."""
    if max_length is None or len(ids) <= max_length:
        return ids, mask, False
    sl = slice(None, max_length) if mode == "keep_start" else slice(-max_length, None)
    return ids[sl], mask[sl], True


def encode_example(enc: Encoder, example: dict, max_length: int | None, mode: str, kto: bool) -> dict | None:
    """The sequences (ids, mask) of one pair or KTO example, cut to max_length; None when its prompt fills it."""
    keys = ("completion",) if kto else ("chosen", "rejected")
    prompt_ids, completions = enc.split(example["prompt"], [example[k] for k in keys])
    if max_length is not None and len(prompt_ids) >= max_length and (kto or mode == "keep_start"):
        return None
    out, cut = [], 0
    for ids in completions:
        full = prompt_ids + ids
        seq, mask, was_cut = truncate(full, [0] * len(prompt_ids) + [1] * len(ids), max_length, mode)
        out.append((np.asarray(seq, np.int64), np.asarray(mask, np.uint8)))
        cut += int(was_cut)
    return {"sequences": out, "cut": cut, "prompt_tokens": len(prompt_ids)}


def _first_kind(paths, forced: str | None) -> str:
    if forced is not None:
        return forced
    for path in paths:
        for where, _, record in iter_records(path):
            kind = detect_kind(record) if isinstance(record, dict) else None
            if kind is None:
                raise UserError(f"{where}: not a preference record: expected 'chosen'/'rejected' or KTO's 'label'")
            return kind
    raise UserError(f"--input: no records in {', '.join(map(str, paths))}")


def read_examples(paths, kind: str):
    """(file index, line, normalized example) of every record, each checked (data/preference_records.py)."""
    for file_index, path in enumerate(paths):
        for where, n, record in iter_records(path):
            if not isinstance(record, dict):
                raise UserError(f"{where}: a JSON {json_type(record)}: each record must be a JSON object")
            example = to_unpaired(record, where) if kind == "kto" else to_pair(record, where)
            yield file_index, n, example


def _new_report(kind: str) -> dict:
    report = {"examples": 0, "sequences_cut": 0, "dropped_prompt_too_long": 0, "tokens": 0, "completion_tokens": 0}
    report.update({"pairs": 0, "identical_pairs": 0} if kind == "preference" else {"desirable": 0, "undesirable": 0})
    return report


def _count(report: dict, example: dict, encoded: dict, kind: str) -> None:
    report["examples"] += 1
    report["sequences_cut"] += encoded["cut"]
    for seq, mask in encoded["sequences"]:
        report["tokens"] += len(seq)
        report["completion_tokens"] += int(mask.sum())
    if kind == "preference":
        report["pairs"] += 1
        report["identical_pairs"] += int(example["chosen"] == example["rejected"])
    else:
        report["desirable" if example["label"] else "undesirable"] += 1


def _tokenize_all(enc, paths, kind, max_length, mode, val_fraction) -> tuple[dict, dict, tuple | None]:
    every = round(1 / val_fraction) if val_fraction > 0 else 0
    splits = {s: {"ids": [], "masks": [], "labels": []} for s in ("train", "validation")}
    report, example = _new_report(kind), None
    for _, _, ex in read_examples(paths, kind):
        encoded = encode_example(enc, ex, max_length, mode, kind == "kto")
        if encoded is None:
            report["dropped_prompt_too_long"] += 1
            continue
        split = "validation" if every and report["examples"] % every == every - 1 else "train"
        _count(report, ex, encoded, kind)
        for seq, mask in encoded["sequences"]:
            splits[split]["ids"].append(seq)
            splits[split]["masks"].append(mask)
        if kind == "kto":
            splits[split]["labels"].append(int(ex["label"]))
        example = example or encoded["sequences"]
    if not splits["train"]["ids"]:
        dropped = report["dropped_prompt_too_long"]
        why = f": all {dropped} had a prompt of max_length={max_length} tokens or more" if dropped else ""
        raise UserError(f"--input: no usable preference examples in {', '.join(map(str, paths))}{why}")
    return splits, report, example


def preprocess_preference(
    inputs: list,
    tokenizer: str | Path,
    output: str | Path,
    *,
    kind: str | None = None,
    template: str | None = None,
    max_length: int | None = DEFAULT_MAX_LENGTH,
    truncation_mode: str = "keep_start",
    val_fraction: float = 0.05,
    overwrite: bool = False,
    console: Console | None = None,
) -> dict:
    """Tokenize preference records into the dataset directory `output`; returns the summary (meta.json + timing)."""
    t0, console = time.perf_counter(), console or Console()
    if kind is not None and kind not in KINDS:
        raise UserError(f"--format {kind!r}: one of {', '.join(KINDS)}")
    if truncation_mode not in TRUNCATION_MODES:
        raise UserError(f"--truncation-mode {truncation_mode!r}: one of {', '.join(TRUNCATION_MODES)}")
    if max_length is not None and max_length < 1:
        raise UserError(f"--max-length {max_length}: must be at least 1 (tokens per prompt + completion)")
    paths, out, keep = prepare_output(inputs, tokenizer, output, val_fraction, overwrite, console)
    kind = _first_kind(paths, kind)
    needs_template = any(not isinstance(ex["prompt"], str) for _, _, ex in _first(read_examples(paths, kind)))
    tok, tok_dir, tok_cfg, chat = open_tokenizer(tokenizer, template, needs_template)
    enc = Encoder(tok, chat, template_tokens(tok_cfg))
    splits, report, example = _tokenize_all(enc, paths, kind, max_length, truncation_mode, val_fraction)
    tok_bytes = (tok_dir / "tokenizer.json").read_bytes()
    tok_keys, dtype = tokenizer_meta(tok, tok_dir, tok_bytes)
    meta = {
        "format": FORMAT,
        "kind": "pairs" if kind == "preference" else "unpaired",
        **tok_keys,
        "max_length": max_length,
        "truncation_mode": truncation_mode,
        "report": report,
        "template_name": template,
    }
    write = functools.partial(_write, kind=kind)
    meta = publish_dataset(out, meta, splits, dtype, (tok_bytes, tok_cfg, chat), (paths, overwrite, keep), write)
    summary = {**meta, "output": str(out), "seconds": round(time.perf_counter() - t0, 3)}
    _print_report(console, summary, tok, example)
    return summary


def _first(iterator):
    """The first item of an iterator, as a list of at most one (closing the file it reads)."""
    for item in iterator:
        return [item]
    return []


def _write(tmp: Path, split: str, data: dict, dtype, kind: str) -> dict:
    info = write_split(tmp, split, data, dtype)
    per = 2 if kind == "preference" else 1
    info = {"tokens": info["tokens"], "sequences": info["documents"], "samples": info["documents"] // per}
    if kind == "kto":
        (tmp / f"{split}.label.bin").write_bytes(np.asarray(data["labels"], np.uint8).tobytes())
    return info


def _print_report(console: Console, s: dict, tok, example) -> None:
    r = s["report"]
    p = lambda text: console.print(text, soft_wrap=True)  # noqa: E731
    what = "preference pairs" if s["kind"] == "pairs" else "unpaired (KTO) examples"
    p(f"[bold]wrote {escape(s['output'])}[/bold] in {s['seconds']:.2f}s ({what}, {FORMAT})")
    tr, va = s["splits"]["train"], s["splits"]["validation"]
    p(f"  examples    {r['examples']} kept ({tr['samples']} train, {va['samples']} validation)")
    p(
        f"  max_length  {s['max_length']} ({s['truncation_mode']}): {r['sequences_cut']} cut, "
        f"{r['dropped_prompt_too_long']} dropped (prompt alone fills max_length)"
    )
    if s["kind"] == "pairs":
        p(f"  identical   {r['identical_pairs']} pairs with the same chosen and rejected text (kept; no gradient)")
    else:
        p(f"  labels      {r['desirable']} desirable, {r['undesirable']} undesirable")
    p(f"  completions {r['completion_tokens']:,} of {r['tokens']:,} tokens")
    if example is not None:
        for name, (ids, mask) in zip(("chosen", "rejected") if s["kind"] == "pairs" else ("completion",), example):
            parts = []
            for t, m in zip(ids.tolist(), mask.tolist()):
                piece = escape(tok.decode([t], skip_special_tokens=False))
                parts.append(f"[bold green]{piece}[/bold green]" if m else f"[dim]{piece}[/dim]")
            p(f"  first {name} (completion tokens in green):")
            p("    " + "".join(parts).replace("\n", "\n    "))
