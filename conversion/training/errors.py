"""How a training run fails: diverged (non-finite loss or weights) or interrupted (Ctrl-C). Both say what was saved
and how to go on; the CLI prints them as one line and exits 1
(`RunFailed`; 130 for an interrupt)."""

from ..errors import RunFailed


class TrainingDiverged(RunFailed):
    """The loss or the weights became non-finite; no checkpoint holding non-finite values was written."""


class RunInterrupted(RunFailed, KeyboardInterrupt):
    """Ctrl-C during training. Also a `KeyboardInterrupt`, so that code (and tests) handling an interrupt still see
    one; as a `RunFailed` the CLI prints its message (where the run stopped, how to resume) instead of a traceback,
    and exits 130 as shells do for SIGINT."""

    exit_code = 130
