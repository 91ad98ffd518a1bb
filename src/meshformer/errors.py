"""The one exception type that means "the user's input is wrong".

The CLI catches it, prints its message as a single line on stderr and exits with code 2; every other
exception is a bug and keeps its traceback.
"""


class UserError(Exception):
    """Bad input (file, config field, dataset, layout). The message names the field and the fix."""

    exit_code = 2
