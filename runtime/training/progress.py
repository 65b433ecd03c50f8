"""The worker's progress events: emitted as `@@specpipe {json}` lines on rank 0's stdout under torchrun (a callback
in-process), read back from that stdout, and shown as the stage's progress bars and log lines (`Bars`)."""
from __future__ import annotations

import json

PROGRESS_PREFIX = "@@specpipe "


def emit_stdout(ev: dict) -> None:
    print(PROGRESS_PREFIX + json.dumps(ev), flush=True)


def follow_output(lines, bars: Bars, errors: list[str], log) -> None:
    """Rank 0's stdout: progress events to the bars (error messages collected), other lines to the debug log."""
    for line in lines:
        if line.startswith(PROGRESS_PREFIX):
            ev = json.loads(line[len(PROGRESS_PREFIX):])
            if ev.get("event") == "error":
                errors.append(ev["message"])
            bars(ev)
        elif line.strip():
            log.debug("torchrun: %s", line.rstrip())


class Bars:
    """Turns runtime progress events into the stage's progress bars (`progress(total=, desc=)`, a context manager
    as `StageContext.progress`) and log lines."""

    ESTIMATE_AFTER = 6   # steps of this run timed before the estimate (the first is a warm-up)

    def __init__(self, progress, log):
        self.progress = progress
        self.log = log
        self.bar = None
        self.step_s: list[float] = []
        self.total = self.start = 0

    def _open(self, total: int, done: int, desc: str) -> None:
        self.close()
        self.bar = self.progress(total=total, desc=desc).__enter__()
        if done:
            self.bar.update(done)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None

    def __call__(self, ev: dict) -> None:
        kind = ev.get("event")
        if kind == "dump_start":
            self.log.info("offline: dumping target hidden states, %d of %d samples already on disk", ev["done"], ev["total"])
            self._open(ev["total"], ev["done"], "dump hidden states")
        elif kind == "dump" and self.bar:
            self.bar.update(ev.get("n", 1))
        elif kind == "resume":
            self.log.info("resuming training from the checkpoint at step %d", ev["step"])
        elif kind == "train_start":
            self.total, self.start, self.step_s = ev["total"], ev["done"], []
            self._open(ev["total"], ev["done"], f"train draft ({ev.get('world_size', 1)} proc)")
        elif kind == "step":
            if self.bar:
                acc = "/".join(f"{a:.2f}" for a in ev.get("accuracy", []))
                self.bar.update(1, loss=f"{ev['loss']:.3f}", acc=acc)
            self._estimate(ev)
        elif kind == "eval_point":
            self.log.info("held-out AL at step %d: mean %.3f (%s; %.1f s), best %.3f at step %d", ev["step"], ev["mean"],
                          ", ".join(f"{d} {v:.2f}" for d, v in ev["al"].items()), ev["seconds"], ev["best_mean"],
                          ev["best_step"])
        elif kind == "budget":
            self._budget(ev)
        elif kind == "budget_stop":
            self.log.warning("train_draft.max_minutes: the steps took %.1f min, the %g-minute budget, by step %d (the "
                             "resolved %s steps did not fit: the machine slowed): stopping here and exporting this step",
                             ev["spent_s"] / 60, ev["max_minutes"], ev["step"], ev["resolved_steps"])
        elif kind == "early_stop":
            self.log.info("%s", ev["reason"])
        elif kind == "export_choice":
            self.log.info("exporting the draft of step %d: %s", ev["step"], ev["reason"])
        elif kind == "d2t":
            self.log.info("draft vocabulary: %d tokens cover %.2f%% of the trained-on tokens; %.2f%% of the held-out "
                          "split's assistant tokens fall outside it", ev["draft_vocab_size"], 100 * ev["token_coverage"],
                          100 * (ev.get("heldout_oov_rate") or 0.0))
        elif kind == "checkpoint":
            self.log.debug("checkpoint at step %d", ev["step"])
        elif kind == "error":
            self.log.error("%s", ev["message"])

    def _budget(self, ev: dict) -> None:
        """train_draft.max_minutes resolved: the step count that fits this machine's measured rate."""
        n, conf = ev["steps"], ev["configured_steps"]
        self.log.info("train_draft.max_minutes %g: measured %.2f s a step here, %.1f min spent: %s", ev["max_minutes"],
                      ev["rate_s"], ev["spent_s"] / 60, f"all {conf} configured steps fit" if n >= conf else
                      f"training {n} of the {conf} configured steps (the learning-rate schedule ends at {n})")
        self.total = n
        if self.bar is not None and hasattr(self.bar, "set_total"):
            self.bar.set_total(n)

    def _estimate(self, ev: dict) -> None:
        """Once, after ESTIMATE_AFTER steps of this run: the time the remaining steps take at this machine's measured
        rate (the median step after the first), logged (eval points and export come on top)."""
        if "step_s" not in ev or len(self.step_s) >= self.ESTIMATE_AFTER:
            return
        self.step_s.append(float(ev["step_s"]))
        if len(self.step_s) < self.ESTIMATE_AFTER:
            return
        timed = sorted(self.step_s[1:])
        rate = timed[len(timed) // 2]
        left = max(0, self.total - ev["step"])
        self.log.info("measured %.2f s a step on this machine (median of steps %d-%d): the remaining %d steps take "
                      "~%.1f min (eval points and export on top)", rate, self.start + 2, ev["step"], left, rate * left / 60)
