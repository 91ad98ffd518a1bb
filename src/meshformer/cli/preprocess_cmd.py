"""`meshformer preprocess --input FILE [FILE ...] --tokenizer DIR --output DIR [--val-fraction F]
[--keep-duplicates] [--overwrite]`: text -> packed token dataset (sequence length is chosen at training time);
instruction data (.jsonl, or .json arrays, in alpaca, messages or sharegpt form) -> samples with a loss mask
(data/sft.py)."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "preprocess",
        help="Tokenize text files into a packed training dataset.",
        description="Tokenize .txt/.jsonl/.json files into DIR (meta.json, tokenizer.json, "
        "{train,validation}.bin), dropping exact duplicate documents.",
    )
    p.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="FILE",
        help='.txt files (one document each), .jsonl files (one {"text": ...} or instruction record per line) or '
        ".json arrays of such records",
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
        choices=("auto", "text", "alpaca", "messages", "sharegpt"),
        help="input kind (default: from the fields of the first .jsonl/.json record)",
    )
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
        "--overlong", default="truncate", choices=("truncate", "drop"), help="instruction data: longer samples"
    )
    p.add_argument(
        "--train-on-prompt", action="store_true", help="instruction data: count prompt tokens in the loss too"
    )
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
        help="treat each blank-line-separated paragraph of a .txt file as its own document",
    )
    p.set_defaults(func=run)


def input_format(args) -> str:
    """text, or the instruction format of the first record of the first .jsonl/.json input that has one (auto)."""
    if args.format != "auto":
        return args.format
    from pathlib import Path

    from meshformer.data.documents import iter_records
    from meshformer.data.sft import detect_format

    for name in args.input:
        p = Path(name)
        if p.suffix.lower() not in (".jsonl", ".json") or not p.is_file():
            return "text"  # the text path reports what is wrong with the inputs
        for where, _, record in iter_records(p):  # a damaged file is one line here, as on the text path
            if isinstance(record, dict) and args.text_field not in record:
                return detect_format(record, where)
            return "text"
    return "text"


def run(args: argparse.Namespace) -> int:
    from meshformer.data.preprocess import preprocess

    fmt = input_format(args)
    if fmt != "text":
        from meshformer.data.sft import preprocess_sft

        preprocess_sft(
            args.input,
            args.tokenizer,
            args.output,
            fmt=fmt,
            template=args.template,
            seq_length=args.seq_length,
            overlong=args.overlong,
            train_on_prompt=args.train_on_prompt,
            val_fraction=args.val_fraction,
            overwrite=args.overwrite,
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
    )
    return 0
