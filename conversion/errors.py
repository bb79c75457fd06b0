"""User-facing errors: problems a user can fix, whose message names the problem and the fix.

The CLI prints an `ExpertizeError` as one line (`expertize <command>: error: ...`) and exits 2, never with a
traceback; anything else escaping a command is a bug in expertize and keeps its traceback. An `ExpertizeWarning`
prints as one line too (`expertize: warning: ...`, as every status line), never with Python's source line.
"""


class ExpertizeError(Exception):
    """A problem with the user's input or environment; the message says what is wrong and how to fix it."""


class RunFailed(ExpertizeError):
    """A run started but cannot produce a trustworthy result (diverged, interrupted, data ran out); what was saved
    and how to continue are in the message. The CLI exits 1 for these (2 is for input refused up front)."""

    exit_code = 1


class DataError(ExpertizeError, ValueError):
    """The corpus cannot give what the recipe asks of it (unreadable file, too little text, empty held-out split,
    a tokenizer that yields no tokens); the message names the fix."""


class ExpertizeWarning(UserWarning):
    """A warning of expertize's own: the message names the problem and the fix. Under the CLI it prints as one line
    (`expertize: warning: ...`); in Python it is an ordinary `UserWarning` (filter or record it as one)."""
