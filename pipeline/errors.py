"""The project's own exception types. Only `pipeline.cli` turns them into output and exit codes."""
from __future__ import annotations


class SpecpipeError(Exception):
    """Base class."""


class ConfigError(SpecpipeError):
    """One or more config problems, each a (dotted path, message) pair. Exit code 2."""

    def __init__(self, problems: list[tuple[str, str]], source: str | None = None):
        self.problems = problems
        self.source = source
        super().__init__("\n".join(self.lines()))

    def lines(self) -> list[str]:
        return [f"{path}: {msg}" if path else msg for path, msg in self.problems]


class UsageError(SpecpipeError):
    """Bad command-line usage not caught by click (unknown stage name, missing workdir). Exit code 2."""


class StageError(SpecpipeError):
    """An expected stage failure (a failed check or gate). Exit code 1; the message is shown as is.

    `metrics` (JSON-able) are kept although nothing is committed: a failed gate's table of measured vs
    required stays visible in `status --json` (`failed_metrics`) and the report."""

    def __init__(self, message: str, metrics: dict | None = None):
        super().__init__(message)
        self.metrics = metrics or {}


class LockedError(SpecpipeError):
    """Another specpipe process holds the workdir. Exit code 1."""
