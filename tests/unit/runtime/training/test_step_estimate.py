"""train_draft's early estimate: after a few steps, the remaining steps at this machine's measured step time."""
from __future__ import annotations

import contextlib
import logging

from runtime.training.progress import Bars


class _Bar:
    def update(self, n, **kw):
        pass


def _progress(total=None, desc=""):
    return contextlib.nullcontext(_Bar())


def test_the_estimate_uses_the_measured_steps_of_this_run(caplog):
    bars = Bars(_progress, logging.getLogger("specpipe.test"))
    times = [9.0, 5.0, 5.2, 4.8, 5.1, 30.0, 1.0]        # a slow first step (warm-up), an outlier, then more steps
    with caplog.at_level(logging.INFO, logger="specpipe.test"):
        bars({"event": "train_start", "total": 600, "done": 100})   # resumed at step 100
        for i, s in enumerate(times):
            bars({"event": "step", "step": 101 + i, "loss": 1.0, "accuracy": [0.5], "step_s": s})
    lines = [r.getMessage() for r in caplog.records if "a step on this machine" in r.getMessage()]
    # once, after 6 steps: the median of steps 2-6 (5.0, 5.2, 4.8, 5.1, 30.0 -> 5.1) x the 494 steps left
    assert lines == ["measured 5.10 s a step on this machine (median of steps 102-106): the remaining 494 steps take "
                     "~42.0 min (eval points and export on top)"]
