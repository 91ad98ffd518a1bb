"""The summary `meshformer preprocess` prints: documents read, duplicates, each split's tokens, the tokenizer."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape


def print_summary(console: Console, s: dict, tok_file: Path) -> None:
    tr, va = s["splits"]["train"], s["splits"]["validation"]
    mode = {
        "document": "whole documents chosen by content hash",
        "tail": f"last {s['val_fraction']:.1%} of every document's tokens",
        "none": "none (--val-fraction 0)",
    }[s["split_mode"]]
    dup = s["duplicates_found"]
    dup_style = "bold yellow" if dup else "green"
    dup_what = (
        "none"
        if not dup
        else f"{dup} dropped"
        if s["duplicates_removed"]
        else f"{dup} KEPT (--keep-duplicates): repeated text makes the loss look lower than it is"
    )
    p = lambda text: console.print(text, soft_wrap=True)  # noqa: E731 - paths must not wrap mid-line
    p(f"[bold]wrote {escape(s['output'])}[/bold] in {s['seconds']:.2f}s")
    p(f"  documents   {s['documents_read']} read, {s['empty_documents_skipped']} empty skipped")
    p(f"  duplicates  [{dup_style}]{dup} exact duplicate document(s) found: {dup_what}[/{dup_style}]")
    p(f"  train       {tr['tokens']:,} tokens in {tr['documents']} documents")
    p(f"  validation  {va['tokens']:,} tokens in {va['documents']} documents ({mode})")
    p(
        f"  tokenizer   {escape(str(tok_file))} (vocab {s['vocab_size']}, eos id {s['eos_token_id']}, "
        f"sha256 {s['tokenizer_hash'][:12]}), stored as {s['dtype']}"
    )
