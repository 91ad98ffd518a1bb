"""Tokenize .txt/.jsonl/.json files into DIR (meta.json, tokenizer.json, {train,validation}.bin), dropping exact
duplicate documents.

`meshformer preprocess --input FILE [FILE ...] --tokenizer DIR --output DIR [--val-fraction F]
[--keep-duplicates] [--overwrite] [--text-split file|paragraph|line] [--workers N] [--format megatron]`: text
(.txt, .jsonl, .json, .parquet, .arrow, datasets.save_to_disk folders) -> packed token dataset (sequence length is
chosen at training time) or a Megatron indexed dataset, streamed; instruction data (the same files, in alpaca,
messages or sharegpt form) -> samples with a loss mask (data/sft.py); preference data (TRL's prompt/chosen/rejected
or prompt/completion/label records, LLaMA-Factory's ranking and kto_tag records) -> pairs or KTO examples with
completion masks, tokenized as TRL 1.16 does (data/preference.py)."""

from __future__ import annotations

import argparse
import os

from meshformer.cli.commands import add_command

SMALL_INPUT_BYTES = 16 << 20  # below this, worker processes cost more to start than they save
MAX_DEFAULT_WORKERS = 8


def add_parser(subparsers) -> None:
    p = add_command(subparsers, "preprocess", "Tokenize text files into a packed training dataset.", __doc__)
    p.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="FILE",
        help='.txt files (see --text-split), .jsonl files (one {"text": ...} or instruction record per line), '
        ".json arrays of such records, .parquet / .arrow files or datasets.save_to_disk folders (their rows)",
    )
    p.add_argument(
        "--tokenizer",
        required=True,
        metavar="DIR",
        help="directory holding tokenizer.json (or the file): a model directory or a meshformer checkpoint",
    )
    p.add_argument(
        "--format",
        default="auto",
        choices=("auto", "text", "alpaca", "messages", "sharegpt", "preference", "kto", "megatron"),
        help="input kind (default: from the fields of the first record); preference: pairs (chosen/rejected); "
        "kto: unpaired examples (prompt/completion/label or kto_tag); megatron: text written as a Megatron "
        "indexed dataset DIR/text_document.bin/.idx, every kept document + EOS, no validation split (Megatron's "
        "`split` makes it at training time)",
    )
    add_sample_options(p)
    p.add_argument("--output", required=True, metavar="DIR", help="dataset directory to create")
    p.add_argument(
        "--val-fraction",
        type=float,
        default=0.02,
        metavar="F",
        help="share of the text held out for validation (default 0.02)",
    )
    p.add_argument(
        "--keep-duplicates",
        action="store_true",
        help="keep exact duplicate documents (they make the loss look lower than it is)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty existing output directory")
    p.add_argument("--text-field", default="text", metavar="NAME", help="JSON field holding the text in .jsonl")
    p.add_argument(
        "--split-blank-lines",
        action="store_true",
        help="treat each blank-line-separated paragraph of a .txt file as its own document (--text-split paragraph)",
    )
    p.add_argument(
        "--text-split",
        default=None,
        choices=("file", "paragraph", "line"),
        help=".txt documents: the whole file (default), each blank-line-separated paragraph, or each line",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="tokenizer processes (0: this process; default: one per CPU up to "
        f"{MAX_DEFAULT_WORKERS}, or 0 for inputs under {SMALL_INPUT_BYTES >> 20} MB)",
    )
    p.set_defaults(func=run)


def add_sample_options(p) -> None:
    """The flags of instruction and preference data: template, lengths, truncation, what the loss counts."""
    p.add_argument(
        "--template",
        default=None,
        metavar="NAME|FILE",
        help="instruction data: chat template (chatml, llama3, llama2, a .jinja file; default: the tokenizer's)",
    )
    p.add_argument(
        "--seq-length",
        type=int,
        default=2048,
        metavar="N",
        help="instruction data: longest sample in tokens (longer: see --overlong)",
    )
    p.add_argument(
        "--max-length",
        "--cutoff-len",
        dest="max_length",
        type=int,
        default=None,
        metavar="N",
        help="preference data: longest prompt + completion in tokens (TRL's max_length, LLaMA-Factory's cutoff_len; "
        "default 1024)",
    )
    p.add_argument(
        "--truncation-mode",
        default="keep_start",
        choices=("keep_start", "keep_end"),
        help="preference data: which end of a longer sequence to keep (TRL's truncation_mode)",
    )
    p.add_argument(
        "--overlong", default="truncate", choices=("truncate", "drop"), help="instruction data: longer samples"
    )
    p.add_argument(
        "--train-on-prompt", action="store_true", help="instruction data: count prompt tokens in the loss too"
    )


def input_format(args) -> str:
    """text, or the instruction format of the first record of the first .jsonl/.json input that has one (auto)."""
    if args.format != "auto":
        return "text" if args.format == "megatron" else args.format
    from pathlib import Path

    from meshformer.data.documents import iter_records
    from meshformer.data.preference_records import detect_kind
    from meshformer.data.sft import detect_format
    from meshformer.data.sources import ARROW_SUFFIXES, is_dataset_dir

    for name in args.input:
        p = Path(name)
        records = p.suffix.lower() in (".jsonl", ".json", *ARROW_SUFFIXES) and p.is_file()
        if not records and not is_dataset_dir(p):
            return "text"  # the text path reports what is wrong with the inputs
        for where, _, record in iter_records(p):  # a damaged file is one line here, as on the text path
            if isinstance(record, dict) and detect_kind(record) is not None:
                return detect_kind(record)
            if isinstance(record, dict) and args.text_field not in record:
                return detect_format(record, where)
            return "text"
    return "text"


def default_workers(inputs: list[str]) -> int:
    """One process per CPU (up to MAX_DEFAULT_WORKERS), or none for small inputs (MindSpore's num_parallel_workers
    plays this part in its pre-processing)."""
    from pathlib import Path

    size = 0
    for name in inputs:
        p = Path(name)
        files = (f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p] if p.is_file() else []
        size += sum(f.stat().st_size for f in files)
    return 0 if size < SMALL_INPUT_BYTES else min(MAX_DEFAULT_WORKERS, os.cpu_count() or 1)


def run(args: argparse.Namespace) -> int:
    from meshformer.data.preprocess import preprocess

    fmt = input_format(args)
    paths = (args.input, args.tokenizer, args.output)
    common = dict(template=args.template, val_fraction=args.val_fraction, overwrite=args.overwrite)
    if fmt in ("preference", "kto"):
        from meshformer.data.preference import DEFAULT_MAX_LENGTH, preprocess_preference

        max_length = DEFAULT_MAX_LENGTH if args.max_length is None else args.max_length
        preprocess_preference(*paths, kind=fmt, max_length=max_length, truncation_mode=args.truncation_mode, **common)
        return 0
    if fmt != "text":
        from meshformer.data.sft import preprocess_sft

        preprocess_sft(
            *paths,
            fmt=fmt,
            seq_length=args.seq_length,
            overlong=args.overlong,
            train_on_prompt=args.train_on_prompt,
            **common,
        )
        return 0

    preprocess(
        args.input,
        args.tokenizer,
        args.output,
        val_fraction=args.val_fraction,
        keep_duplicates=args.keep_duplicates,
        overwrite=args.overwrite,
        text_field=args.text_field,
        split_blank_lines=args.split_blank_lines,
        text_split=args.text_split,
        workers=default_workers(args.input) if args.workers is None else args.workers,
        output_format="megatron" if args.format == "megatron" else "packed",
    )
    return 0
