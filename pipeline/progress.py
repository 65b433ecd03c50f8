"""Progress reporting: a rich bar on a terminal, plain log lines (about every 10 %) otherwise."""
from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable


class Progress:
    def __init__(self, log: logging.Logger, *, total: int | None, desc: str, iterable: Iterable | None = None):
        self.log = log
        self.iterable = iterable
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self.total = total
        self.desc = desc
        self.n = 0
        self.fields: dict[str, str] = {}
        self._bar = None
        self._task = None
        self._t0 = time.monotonic()
        self._next_log = 0.0

    def __enter__(self) -> Progress:
        if sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TimeRemainingColumn(), TextColumn("{task.fields[info]}"), transient=False,
            )
            self._bar.__enter__()
            self._task = self._bar.add_task(self.desc, total=self.total, info="")
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)
        elif exc[0] is None:
            self._log_line(final=True)

    def set_total(self, total: int) -> None:
        """A new total once known better (a training budget's resolved step count)."""
        self.total = total
        if self._bar is not None:
            self._bar.update(self._task, total=total)

    def __iter__(self):
        assert self.iterable is not None
        for item in self.iterable:
            yield item
            self.update(1)

    def update(self, n: int = 1, **fields) -> None:
        self.n += n
        self.fields.update({k: str(v) for k, v in fields.items()})
        info = " ".join(f"{k}={v}" for k, v in self.fields.items())
        if self._bar is not None:
            self._bar.update(self._task, advance=n, info=info)
            return
        if self.total:
            frac = self.n / self.total
            if frac >= self._next_log:
                self._log_line()
                self._next_log = frac + 0.1

    def _log_line(self, final: bool = False) -> None:
        info = " ".join(f"{k}={v}" for k, v in self.fields.items())
        of = f"/{self.total}" if self.total else ""
        took = time.monotonic() - self._t0
        self.log.info("%s %d%s %s(%.1fs)%s", self.desc, self.n, of, info + " " if info else "", took, " done" if final else "")
