"""`meshformer preprocess --input FILE [FILE ...] --tokenizer DIR --output DIR [--val-fraction F]
[--keep-duplicates] [--overwrite]`: text -> packed token dataset (sequence length is chosen at training time)."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "preprocess",
        help="Tokenize text files into a packed training dataset.",
        description="Tokenize .txt/.jsonl files into DIR (meta.json, tokenizer.json, "
        "{train,validation}.bin), dropping exact duplicate documents.",
    )
    p.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="FILE",
        help='.txt files (one document each) or .jsonl files (one {"text": ...} per line)',
    )
    p.add_argument(
        "--tokenizer", required=True, metavar="DIR", help="directory holding tokenizer.json (or the file itself)"
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


def run(args: argparse.Namespace) -> int:
    from meshformer.data.preprocess import preprocess

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
