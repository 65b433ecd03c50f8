"""The regeneration's answers journal (`scratch/data/<fingerprint>/regenerate/answers.jsonl`): every answer appended
as it arrives, one JSON line `{"i": prompt index, "k": sample key, "t": generated ids}`, written through to the OS at
once (a killed process loses nothing written) and fsync'd at most `fsync_s` apart (a power cut loses at most that
much). A rerun reads it back: lines whose index and key match this run's plan fill the answers, so an answered prompt
is never asked again and never written twice; a torn last line (a kill mid-write) is cut off; stale or repeated lines
are skipped and counted. The scratch directory is keyed by the stage's fingerprint, so the plan and the answers are
bound to the config and code that made them."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

FSYNC_S = 1.0     # at most this long between fsyncs of the journal


class AnswerLog:
    """Append-only answers of one regeneration plan (`keys[i]`: prompt i's sample key). `path` None: nothing kept."""

    def __init__(self, path: Path | None, keys: list[str], fsync_s: float = FSYNC_S):
        self.path, self.keys, self.fsync_s = path, keys, fsync_s
        self._f = None
        self._last_sync = time.monotonic()
        self.loaded = {"answers": 0, "torn_bytes": 0, "stale": 0, "repeated": 0, "unreadable": 0}

    def load(self, results: list) -> int:
        """Fill `results[i]` from the journal (first answer of each prompt); cut a torn last line. Returns answers read."""
        if self.path is None or not self.path.exists():
            return 0
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1                 # everything after the last newline is a torn write
        if end < len(data):
            self.loaded["torn_bytes"] = len(data) - end
            with open(self.path, "r+b") as f:
                f.truncate(end)
                os.fsync(f.fileno())
        n, keys = 0, self.keys
        for line in data[:end].splitlines():
            try:
                rec = json.loads(line)
                i, k, t = rec["i"], rec["k"], rec["t"]
            except (ValueError, KeyError, TypeError):
                self.loaded["unreadable"] += 1
                continue
            if not (isinstance(i, int) and 0 <= i < len(keys) and keys[i] == k and isinstance(t, list)):
                self.loaded["stale"] += 1
            elif results[i] is not None:
                self.loaded["repeated"] += 1
            else:
                results[i] = t
                n += 1
        self.loaded["answers"] = n
        return n

    def append(self, i: int, ids: list[int]) -> None:
        if self.path is None:
            return
        if self._f is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "a", encoding="utf-8")   # noqa: SIM115 - held open for the run, closed by close()
        self._f.write(json.dumps({"i": i, "k": self.keys[i], "t": ids}, separators=(",", ":")) + "\n")
        self._f.flush()                              # to the OS now: a killed process loses nothing written
        now = time.monotonic()
        if now - self._last_sync >= self.fsync_s:
            os.fsync(self._f.fileno())
            self._last_sync = now

    def close(self) -> None:
        if self._f is not None:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            self._f = None

    def __enter__(self) -> AnswerLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
