"""Continuous batching over the speculative engine's step-wise core (`runtime.engine.decode_batch.DecodeBatch`).

One scheduler thread owns the engine. Requests arrive from any thread (`Scheduler.submit`) into a bounded
FIFO queue; between two decoding steps the scheduler admits waiting requests into the running batch (one
prefill forward for everything admitted at once), then steps every live row together: the drafter proposes
for all of them and the target verifies all of them in ONE forward. A request leaves the batch when it hits
an end-of-sequence id, its token budget or a stop string, or when its client cancels or disconnects (polled
through `Job.is_cancelled`, every `cancel_check_s`), which frees its slot for the next waiting request.

Bounds: at most `max_batch` rows decode at once and at most `max_queue` requests wait; `submit` raises
`Overloaded` beyond that, at once, instead of growing a backlog.

Requests whose sampling differs (greedy vs temperature/top_p) use one acceptance rule per batch, so they run in
separate batches that the scheduler steps in turn (`GenerationRequest.sampling_key`); the batch's random
generator is seeded from the request that opened it. Greedy outputs do not depend on what else is in the batch
(up to float rounding of batched matmuls, the same as `generate` with B > 1).

`metrics(name, value)` receives counter increments (`draft_tokens`, `accepted_draft_tokens`,
`verification_steps`, `target_forwards`, `decode_rows`, `output_tokens`, `requests_joined_running_batch`,
`requests_{completed,cancelled,rejected_overloaded,failed}`) and gauges (`batch_rows`, `queue_depth` as
`set:<name>`); the Triton model turns them into Prometheus metrics.
"""
from __future__ import annotations

import collections
import threading
import time
import traceback
from collections.abc import Callable

from runtime.serving.jobs import Group, Job, TextEngine


class Overloaded(RuntimeError):
    """Every batch slot is taken and the waiting queue is at its bound; the client should retry later."""


class Scheduler:
    """The continuous-batching loop on one thread (see the module docstring)."""

    def __init__(self, engine: TextEngine, *, max_batch: int = 8, max_queue: int = 32, cancel_check_s: float = 0.05,
                 metrics: Callable[[str, float], None] | None = None, log: Callable[[str], None] | None = None):
        if max_batch < 1 or max_queue < 0:
            raise ValueError(f"max_batch must be >= 1 and max_queue >= 0, got {max_batch}, {max_queue}")
        self.engine = engine
        self.max_batch, self.max_queue, self.cancel_check_s = max_batch, max_queue, cancel_check_s
        self.metrics = metrics or (lambda *_: None)
        self.log = log or (lambda _m: None)
        self.queue: collections.deque[Job] = collections.deque()
        self.groups: dict[tuple[float, float], Group] = {}
        self.cv = threading.Condition()
        self.running = True
        self._stop_ids: list[str] = []
        self._last_cancel_check = 0.0
        self._last_gauges = (0, 0)
        self.thread = threading.Thread(target=self._loop, name="specpipe-scheduler", daemon=True)
        self.thread.start()

    # -- called from any thread
    def submit(self, job: Job) -> None:
        with self.cv:
            if not self.running:
                raise Overloaded("the model is shutting down")
            live = sum(g.live for g in self.groups.values())
            if live + len(self.queue) >= self.max_batch + self.max_queue:
                self.metrics("requests_rejected_overloaded", 1)
                raise Overloaded(f"overloaded: {live} requests decoding (max_batch {self.max_batch}) and "
                                 f"{len(self.queue)} waiting (max_queue {self.max_queue}); retry later")
            self.queue.append(job)
            self.cv.notify()

    def stop_request(self, request_id: str) -> int:
        """Cancel the live or waiting requests with this id (the interface's `stop` input); returns how many."""
        if not request_id:
            return 0
        with self.cv:
            n = sum(j.request_id == request_id for j in self.queue)
            n += sum(j.request_id == request_id for g in self.groups.values() for j in g.jobs.values())
            if n:
                self._stop_ids.append(request_id)
                self.cv.notify()
            return n

    def shutdown(self, timeout: float = 10.0) -> None:
        with self.cv:
            self.running = False
            self.cv.notify()
        self.thread.join(timeout)

    def snapshot(self) -> dict:
        with self.cv:
            return {"queued": len(self.queue), "live": sum(g.live for g in self.groups.values()),
                    "groups": len(self.groups)}

    # -- the scheduler thread
    def _loop(self) -> None:
        while True:
            with self.cv:
                while self.running and not self.queue and not any(g.live for g in self.groups.values()):
                    self.cv.wait(timeout=self.cancel_check_s)
                    self._check_cancelled_locked()
                if not self.running:
                    break
                admitted = self._admit_locked()
                stop_ids, self._stop_ids = self._stop_ids, []
            for key, jobs in admitted.items():   # joins the running batch: takes part in the next step
                try:
                    self._group(key, jobs[0].req.seed).add(jobs)
                except Exception as e:  # noqa: BLE001 - these requests get the error; the running rows carry on
                    self.log(f"[specpipe] prefill failed: {e}\n{traceback.format_exc()}")
                    for j in jobs:
                        if not j.done.is_set():
                            self.metrics("requests_failed", 1)
                            j.fail(RuntimeError(f"generation failed: {e}"))
            for rid in stop_ids:                 # after admission: a stopped request may just have been admitted
                self._guarded(lambda rid=rid: self._cancel_where(lambda job: job.request_id == rid))
            for key in list(self.groups):
                g = self.groups[key]
                if g.live:
                    self._guarded(g.step, g)
            now = time.monotonic()
            if now - self._last_cancel_check >= self.cancel_check_s:
                self._last_cancel_check = now
                self._guarded(lambda: self._cancel_where(lambda job: job.is_cancelled is not None and job.is_cancelled()))
                with self.cv:
                    self._check_cancelled_locked()
            self._drop_empty()
            self._gauges()
        with self.cv:
            pending = list(self.queue)
            self.queue.clear()
        for j in pending:
            j.fail(Overloaded("the model is shutting down"))
        for g in self.groups.values():
            g.fail_all(Overloaded("the model is shutting down"))

    def _gauges(self) -> None:
        """batch_rows and queue_depth, sent when they change."""
        with self.cv:
            now = (sum(g.live for g in self.groups.values()), len(self.queue))
        if now != self._last_gauges:
            self._last_gauges = now
            self.metrics("set:batch_rows", now[0])
            self.metrics("set:queue_depth", now[1])

    def _guarded(self, fn, group: Group | None = None) -> None:
        """Run one batch operation; if it fails, that batch's requests get the error and the model keeps serving."""
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            self.log(f"[specpipe] batch failed, its requests get the error: {e}\n{traceback.format_exc()}")
            for key, g in list(self.groups.items()):
                if group is None or g is group:
                    g.fail_all(RuntimeError(f"generation failed: {e}"))
                    del self.groups[key]

    def _admit_locked(self) -> dict[tuple[float, float], list[Job]]:
        free = self.max_batch - sum(g.live for g in self.groups.values())
        out: dict[tuple[float, float], list[Job]] = {}
        while free > 0 and self.queue:
            j = self.queue.popleft()
            out.setdefault(j.req.sampling_key, []).append(j)
            free -= 1
        return out

    def _check_cancelled_locked(self) -> None:
        """Waiting requests whose client went away leave the queue (their slot in it is freed)."""
        gone = [j for j in self.queue if j.is_cancelled is not None and j.is_cancelled()]
        for j in gone:
            self.queue.remove(j)
            j.cancelled = True
            self.metrics("requests_cancelled", 1)
            j.fail(Cancelled("request cancelled by client"))

    def _cancel_where(self, pred) -> None:
        with self.cv:
            waiting = [j for j in self.queue if pred(j)]
            for j in waiting:
                self.queue.remove(j)
        for j in waiting:
            j.cancelled = True
            self.metrics("requests_cancelled", 1)
            j.fail(Cancelled("request cancelled by client"))
        for g in self.groups.values():
            keys = [k for k, j in g.jobs.items() if pred(j)]
            if keys:
                g.cancel(keys)

    def _group(self, key, seed) -> Group:
        if key not in self.groups:
            self.groups[key] = Group(self.engine, key, seed, self.metrics)
        return self.groups[key]

    def _drop_empty(self) -> None:
        for key in [k for k, g in self.groups.items() if not g.live]:
            del self.groups[key]


class Cancelled(RuntimeError):
    """A request its client cancelled (or stopped by id) before it was scheduled."""
