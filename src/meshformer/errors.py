"""The exception types that end a command with one line instead of a traceback.

`UserError`: the user's input is wrong (exit code 2). `RunFailed`: the input was fine but the run could not go
on (training diverged; exit code 1). The CLI prints either as a single line on stderr; every other exception
is a bug and keeps its traceback.
"""


class UserError(Exception):
    """Bad input (file, config field, dataset, layout). The message names the field and the fix."""

    exit_code = 2


def first_line(e: BaseException, limit: int = 120) -> str:
    """A library exception in a few words for a one-line error: its message's first line, else its type."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:limit]


class RunFailed(Exception):
    """The run stopped for a reason that is not a bad input (e.g. the loss stayed non-finite). Exit code 1."""

    exit_code = 1
