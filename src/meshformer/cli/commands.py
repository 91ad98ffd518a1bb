"""A sub-command's parser as each `cli/*_cmd.py` module's `add_parser` makes it: its line in `meshformer --help`,
and as its description the first paragraph of the module's docstring, one text for whoever reads the code and
whoever reads `meshformer COMMAND --help`."""

from __future__ import annotations

import argparse


def add_command(subparsers, name: str, help: str, doc: str) -> argparse.ArgumentParser:
    """The parser of sub-command `name`: `help` in the list of commands, `doc`'s first paragraph (the module's
    `__doc__`) as its description."""
    return subparsers.add_parser(name, help=help, description=doc.split("\n\n")[0])
