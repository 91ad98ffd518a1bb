"""A CLI that answers at once: `meshformer --help`, every sub-command's `--help` and an argument error are answered
before torch is imported (importing torch is most of a command's start-up time)."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = r"""
import contextlib, io, json, sys
from meshformer.cli.main import COMMANDS, main
results = {}
for argv in [["--help"], *[[c, "--help"] for c in COMMANDS if c != "config"], ["train"], ["plan", "--bogus"]]:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    results[" ".join(argv)] = [code, "torch" in sys.modules]
print(json.dumps(results))
"""


def test_help_and_argument_errors_answer_before_torch_loads():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout
    results = json.loads(out.splitlines()[-1])
    assert results["--help"] == [0, False]
    assert results["train"] == [2, False] and results["plan --bogus"] == [2, False]  # one-line argument errors
    loaded = [argv for argv, (_, torch_loaded) in results.items() if torch_loaded]
    assert not loaded, f"torch imported by: {loaded}"
    assert len(results) > 15  # every sub-command's help was asked
