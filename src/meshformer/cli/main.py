"""`meshformer` command line: one sub-command per module in this folder.

Each sub-command module exposes `add_parser(subparsers)` (which sets `func` on its parser; cli/commands.py
`add_command` makes the parser, described by the module's docstring). Bad input is
raised as `UserError` anywhere below and reported here as one line with exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from meshformer.cli.arg_errors import OneLineParser, refuse_empty_paths, unrecognized
from meshformer.errors import RunFailed, UserError
from meshformer.train.preemption import StoppedBeforeTraining

# Sub-command modules, in the order `meshformer --help` lists them.
COMMANDS = (
    "train",
    "launch",
    "selfcheck",
    "preprocess",
    "data",
    "tokenizer",
    "generate",
    "eval",
    "convert",
    "template",
    "ckpt",
    "config",
    "plan",
    "doctor",
    "plot",
    "journal",
    "compare",
)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(  # its errors, and its sub-commands' (same class), are one line (cli/arg_errors.py)
        prog="meshformer",
        description=(
            "Pre-train and fine-tune Llama-family models from one YAML file, split across devices by parallel_config."
        ),
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(f"meshformer.cli.{name}_cmd").add_parser(sub)
    return parser


def command_parsers(parser: argparse.ArgumentParser, argv: list[str]) -> list[argparse.ArgumentParser]:
    """The sub-command parsers that argv names, outermost first (`ckpt merge ...`: ckpt's, then merge's)."""
    for action in parser._subparsers._group_actions if parser._subparsers else ():
        sub = getattr(action, "choices", {}).get(argv[0]) if argv else None
        if sub is not None:
            return [sub, *command_parsers(sub, argv[1:])]
    return []


def command_options(parser: argparse.ArgumentParser, argv: list[str]) -> dict[str, argparse.Action]:
    """Option strings (--seed, ...) of the sub-command named first in argv, with their actions, and of its own
    sub-command (`ckpt merge --optimizer`: `--optimizer` is merge's flag, not the `optimizer` config section)."""
    return {flag: act for sub in command_parsers(parser, argv) for flag, act in sub._option_string_actions.items()}


def split_overrides(own: dict[str, argparse.Action], argv: list[str]) -> tuple[list[str], list[str]]:
    """(the command's own arguments, config overrides). Overrides (--section.field VALUE) run from the first one
    to the end of the line, except the sub-command's own options (train --profile 5:7, generate --seed 1), which
    may come anywhere and keep their value."""
    mine, overrides, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        action = own.get(arg.split("=", 1)[0])
        if action is not None:
            takes_value = "=" not in arg and action.nargs != 0 and i + 1 < len(argv)
            mine += argv[i : i + 2] if takes_value else [arg]
            i += 2 if takes_value else 1
            continue
        (overrides if overrides or is_override(arg) else mine).append(arg)
        i += 1
    return mine, overrides


def is_override(arg: str) -> bool:
    """`--section.field` or `--top_level_field`: a config override rather than a command option."""
    from meshformer.config.fields import schema_fields
    from meshformer.config.schema import MeshformerConfig

    if not arg.startswith("--"):
        return False
    key = arg[2:].split("=", 1)[0]
    return "." in key or key in {f.name for f in schema_fields(MeshformerConfig)}


# What shells report for a standard tool (cat, seq, grep) whose reader went away: 128 + SIGPIPE.
BROKEN_PIPE_EXIT = 128 + 13


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Dotted overrides (--section.field VALUE) run to the end of the line; argparse sees the rest. An argument
    nobody takes is refused naming the flag that was probably meant."""
    own = command_options(parser, argv)  # a sub-command's own flags (generate --seed) are never overrides
    mine, overrides = split_overrides(own, argv)
    args, unknown = parser.parse_known_args(mine)
    command = [parser, *command_parsers(parser, argv)][-1]  # the innermost: `ckpt merge`'s, not `ckpt`'s
    takes_overrides = getattr(args, "accepts_overrides", False)
    if not takes_overrides:
        unknown += overrides
    if unknown:
        from meshformer.config.fields import schema_fields
        from meshformer.config.schema import MeshformerConfig

        fields = [f"--{f.name}" for f in schema_fields(MeshformerConfig)] if takes_overrides else []
        raise unrecognized(command.prog, unknown, [*own, *fields], takes_overrides, getattr(args, "option_hints", {}))
    refuse_empty_paths(command, args)
    args.overrides = overrides if takes_overrides else []
    return args


def stdout_reader_gone() -> bool:
    """Whether stdout is a pipe (or socket) whose reading end has closed (`| head` exited): poll says POLLERR."""
    import select

    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, OSError):  # replaced by an object without a descriptor (tests)
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    try:
        args = parse(parser, argv)  # help and argument errors answer before torch loads
        # The models package fills the schema's choices of model_config.type with the families' config classes
        # (config/fields.py MODEL_CONFIGS; no torch), so a typo there is refused when the config loads, before
        # anything else runs.
        importlib.import_module("meshformer.models")
        rc = int(args.func(args) or 0)
        sys.stdout.flush()  # a reader that went away shows here, not in the interpreter's flush at exit
        return rc
    except (UserError, RunFailed) as e:
        print(f"meshformer: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("meshformer: interrupted", file=sys.stderr)
        return 130
    except StoppedBeforeTraining as e:  # preemption before the first step: nothing to save, a clean stop
        print(f"meshformer: {e}", flush=True)
        return 0
    except BrokenPipeError:
        if not stdout_reader_gone():
            raise  # some other pipe or socket: a bug, which keeps its traceback
        # `meshformer ... | head`: the reader has what it wanted. End quietly, as cat or grep do (the shell shows
        # 141); the unwritten output goes to /dev/null so that Python's flush at exit does not complain.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return BROKEN_PIPE_EXIT


if __name__ == "__main__":
    sys.exit(main())
