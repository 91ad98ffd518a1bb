"""argparse's errors as the CLI's one line: `meshformer: error: COMMAND: what is wrong; the fix`, exit code 2.

argparse prints a usage block of up to seven lines before its message; every other bad input of meshformer is
one line (errors.py). The parser here raises UserError instead, which cli/main.py prints like any other, and
names what a flag expects or the flag that was probably meant. `--help` is untouched.
"""

from __future__ import annotations

import argparse
import difflib
import re

from meshformer.errors import UserError

# What argparse's type names mean to someone typing a value.
EXPECTED = {"int": "a whole number", "float": "a number"}
# Arguments that name a file or directory: an empty value would mean the current directory (Path("") is ".").
PATH_ARGS = frozenset(
    {"config", "checkpoint", "input", "output", "tokenizer", "prompts_file", "messages", "source", "directory"}
    | {"path", "runs", "run_a", "run_b", "data", "base"}
)


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are UserError (one line); its sub-command parsers are of this class too."""

    def error(self, message: str):
        raise UserError(f"{command_of(self.prog)}{explain(message)}; see `{self.prog} --help`")


def command_of(prog: str) -> str:
    """`meshformer ckpt merge` -> "ckpt merge: " (nothing for the top-level parser)."""
    words = prog.split()[1:]
    return " ".join(words) + ": " if words else ""


def explain(message: str) -> str:
    """argparse's message, reworded where it can name what was expected (or meant)."""
    m = re.fullmatch(r"argument (\S+): invalid (\w+) value: (.*)", message)
    if m:
        flag, kind, value = m.groups()
        return f"{flag} {value}: expects {EXPECTED.get(kind, f'a valid {kind}')}"
    m = re.fullmatch(r"argument (\S+): invalid choice: '(.*?)' \(choose from (.*)\)", message, re.S)
    if m:
        name, value, listed = m.groups()
        choices = re.findall(r"'([^']*)'", listed) or listed.split(", ")
        return f"{name} {value!r}: not one of {', '.join(choices)}{did_you_mean(value, choices)}"
    m = re.fullmatch(r"argument (\S+): expected one argument", message)
    if m:
        return f"{m.group(1)}: expects a value after it"
    return message


def did_you_mean(word: str, candidates) -> str:
    """` (did you mean X?)` for the candidate closest to word, compared without leading dashes, or nothing."""
    by_name = {c.lstrip("-"): c for c in candidates}
    close = difflib.get_close_matches(word.lstrip("-"), list(by_name), n=1, cutoff=0.6)
    return f" (did you mean {by_name[close[0]]}?)" if close else ""


def unrecognized(prog: str, unknown: list[str], flags, overrides: bool, hints: dict[str, str]) -> UserError:
    """The error for arguments no parser took: the first unknown flag (else argument), with the closest of
    `flags`, or its entry in `hints` (a sub-command's word on a flag it does not have, e.g. launch --nnodes);
    `overrides`: the command also takes config fields as --section.field VALUE."""
    first = next((a for a in unknown if a.startswith("-")), unknown[0])
    name = first.split("=", 1)[0]
    help_ = f"see `{prog} --help`"
    if not name.startswith("-"):
        return UserError(f"{command_of(prog)}unexpected argument {first!r}; {help_}")
    if name in hints:
        return UserError(f"{command_of(prog)}{name}: {hints[name]}")
    if overrides:
        help_ = f"config fields are given as --section.field VALUE (`meshformer config explain` lists them); {help_}"
    elif "." in name:
        help_ = f"{command_of(prog).rstrip(': ') or 'meshformer'} takes no config fields; {help_}"
    return UserError(f"{command_of(prog)}unknown option {name}{did_you_mean(name, flags)}; {help_}")


def refuse_empty_paths(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """An empty path is a mistake (an unset shell variable), not the current directory, which it would mean."""
    for action in parser._actions:
        if action.dest not in PATH_ARGS:
            continue
        value = getattr(args, action.dest, None)
        if any(isinstance(v, str) and not v.strip() for v in (value if isinstance(value, list) else [value])):
            name = "/".join(action.option_strings) or action.metavar or action.dest
            raise UserError(f"{command_of(parser.prog)}{name} is empty: give a path; see `{parser.prog} --help`")
