"""The runtime's own exception types. `runtime/` never imports `pipeline/`: the stage runner treats a
`RuntimeFailure` like a `StageError` (logged as is, nothing committed, exit code 1) and `pipeline.cli` prints it
without a traceback (`RuntimeUsageError`: exit code 2)."""
from __future__ import annotations


class RuntimeFailure(Exception):
    """An expected failure of runtime code, with a message that says what was expected, what was found and what
    to do (a server that does not start, a checkpoint that cannot be served)."""


class RuntimeUsageError(RuntimeFailure):
    """What the caller asked for cannot be done here (a device or dtype this machine lacks)."""
