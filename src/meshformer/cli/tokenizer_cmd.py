"""`meshformer tokenizer train --input FILE [FILE ...] --vocab-size N --output DIR [--overwrite]`."""

from __future__ import annotations

import argparse
import time


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "tokenizer", help="Train a tokenizer.", description="Tokenizer tools; `train` is the only verb for now."
    )
    verbs = p.add_subparsers(dest="tokenizer_command", metavar="VERB", required=True)
    t = verbs.add_parser(
        "train",
        help="Train a byte-level BPE tokenizer on text files.",
        description="Train a byte-level BPE tokenizer (special tokens <|endoftext|>, <|pad|>, "
        "<|im_start|>, <|im_end|>) and write DIR/tokenizer.json.",
    )
    t.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="FILE",
        help='.txt files (one document each) or .jsonl files (one {"text": ...} per line)',
    )
    t.add_argument(
        "--vocab-size",
        type=int,
        required=True,
        metavar="N",
        help="vocabulary size including the 4 special tokens (e.g. 2048 for a small corpus)",
    )
    t.add_argument("--output", required=True, metavar="DIR", help="directory to write tokenizer.json into")
    t.add_argument("--overwrite", action="store_true", help="replace an existing DIR/tokenizer.json")
    t.set_defaults(func=run_train)


def run_train(args: argparse.Namespace) -> int:
    from meshformer.data.tokenizer import load_tokenizer, train_tokenizer, vocab_size

    t0 = time.perf_counter()
    path = train_tokenizer(args.input, args.vocab_size, args.output, overwrite=args.overwrite)
    n = vocab_size(load_tokenizer(path))
    print(f"wrote {path} (vocab {n}) in {time.perf_counter() - t0:.2f}s")
    if n < args.vocab_size:
        print(f"note: the corpus only supports {n} tokens (asked for {args.vocab_size}): add text for more merges")
    print(f"set model.model_config.vocab_size to at least {n}")
    return 0
