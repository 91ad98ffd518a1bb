"""`meshformer template check DIR [--template NAME] [--data DATASET]`: check a chat template against its tokenizer
(and, with --data, that it reproduces an instruction dataset's tokens exactly). Exit 1 when a problem is found."""

from __future__ import annotations

from meshformer.cli.commands import add_command


def add_parser(sub) -> None:
    p = add_command(sub, "template", "check a chat template", __doc__)
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    c = verbs.add_parser("check", help="render, encode and decode sample conversations; report problems")
    c.add_argument("directory", help="a model directory, meshformer checkpoint or exported directory")
    c.add_argument("--template", default=None, help="check a built-in (chatml, llama3, llama2) or a .jinja file")
    c.add_argument("--data", default=None, metavar="DATASET", help="an instruction dataset made with this template")
    p.set_defaults(func=run)


def run(args) -> int:
    from meshformer.data.template_check import check_dataset, check_template

    problems = check_template(args.directory, args.template)
    for p in problems:
        print(f"problem: {p}")
    if args.data:
        n, more = check_dataset(args.directory, args.data)
        for p in more:
            print(f"problem: {p}")
        if not more:
            print(f"{n} held-out conversations of {args.data} render to exactly the stored tokens and loss mask")
        problems += more
    if not problems:
        print(f"{args.directory}: the chat template and tokenizer agree (round trip, special tokens, end of turn)")
    return 1 if problems else 0
