"""One request's life on the engine's step-wise core (`runtime.engine.decode_batch.DecodeBatch`), shared by the
in-process path (`runtime.serving.adapter.ServingEngine.complete`, through `run_alone`) and the continuous-batching
scheduler (`runtime.serving.batching.Scheduler`): the validated request (`GenerationRequest`), its tokens decoded into
text with stop strings and streaming callbacks (`Job`), its result with TensorRT-LLM's per-request statistics
(`Completion`), and one running batch of jobs that share a sampling rule (`Group`). It needs of the serving engine
only what `TextEngine` names, so it imports neither the adapter nor the scheduler."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol


class TextEngine(Protocol):
    """What a job needs of `runtime.serving.adapter.ServingEngine`."""

    engine: object                 # the `runtime.engine.speculative.SpeculativeEngine` (its `batch(...)`)
    draft_len: int
    eos_token_ids: list[int]

    def decode(self, ids: list[int]) -> str: ...


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str                 # "stop" | "length"
    stop_reason: str | None
    total_draft_tokens: int
    total_accepted_draft_tokens: int
    steps: int
    arrival_time_ns: int
    first_token_time_ns: int
    last_token_time_ns: int
    draft_len: int
    chunks: list[str] = field(default_factory=list)   # cumulative text after each decoding step
    first_scheduled_time_ns: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.total_accepted_draft_tokens / self.total_draft_tokens if self.total_draft_tokens else 0.0

    @property
    def acceptance_length(self) -> float:
        return (self.steps + self.total_accepted_draft_tokens) / self.steps if self.steps else 1.0


@dataclass
class GenerationRequest:
    """A validated request: what `ServingEngine.request` returns and the scheduler runs."""

    prompt: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: list[str] = field(default_factory=list)

    @property
    def sampling_key(self) -> tuple[float, float]:
        """Requests with the same key share one running batch (one acceptance rule per batch)."""
        return (0.0, 1.0) if self.temperature <= 0 else (float(self.temperature), float(self.top_p))


class Job:
    """One request's life: decoding its tokens into text, stop strings, streaming callbacks, its result."""

    def __init__(self, engine: TextEngine, req: GenerationRequest, *, on_text: Callable[[str], None] | None = None,
                 on_done: Callable[[Job], None] | None = None, is_cancelled: Callable[[], bool] | None = None,
                 request_id: str = ""):
        self.engine, self.req = engine, req
        self.on_text, self.on_done, self.is_cancelled = on_text, on_done, is_cancelled
        self.request_id = request_id
        self.arrival_ns = now_ns()
        self.scheduled_ns = 0
        self.tokens: list[int] = []
        self.chunks: list[str] = []
        self.times: list[int] = []
        self.stop_hit: str | None = None
        self.result: Completion | None = None
        self.error: BaseException | None = None
        self.cancelled = False
        self.done = threading.Event()

    def push(self, new: list[int]) -> bool:
        """Tokens appended by one decoding step; returns True when a stop string ended the request."""
        self.times.append(now_ns())
        if self.stop_hit is not None:
            return True
        self.tokens.extend(new)
        text = self.engine.decode(self.tokens)
        hit = first_stop(text, self.req.stop)
        if hit is not None:
            self.stop_hit = hit[1]
            text = text[:hit[0]]
        if not self.chunks or text != self.chunks[-1]:
            self.chunks.append(text)
            if self.on_text is not None:
                self.on_text(text)
        return self.stop_hit is not None

    def finish(self, finish: str, stats, draft_len: int) -> None:
        """The request left the batch (`finish` from the batch: stop / length / cancelled)."""
        text = self.engine.decode(self.tokens)
        if self.stop_hit is not None:
            text = text[:first_stop(text, self.req.stop)[0]]
            finish = "stop"
        if finish == "cancelled":
            self.cancelled = True
        self.result = Completion(
            text=text, token_ids=list(self.tokens), finish_reason=finish, stop_reason=self.stop_hit,
            total_draft_tokens=stats.drafted, total_accepted_draft_tokens=stats.accepted, steps=stats.steps,
            arrival_time_ns=self.arrival_ns, first_token_time_ns=self.times[0] if self.times else self.arrival_ns,
            last_token_time_ns=self.times[-1] if self.times else self.arrival_ns, draft_len=draft_len,
            chunks=list(self.chunks), first_scheduled_time_ns=self.scheduled_ns or self.arrival_ns)
        self._done()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._done()

    def _done(self) -> None:
        self.done.set()
        if self.on_done is not None:
            self.on_done(self)


class Group:
    """One running batch (one sampling key) and the jobs of its rows."""

    def __init__(self, engine: TextEngine, key: tuple[float, float], seed: int, metrics):
        from runtime.engine.sampling import Sampling

        self.engine, self.key, self.metrics = engine, key, metrics
        self.batch = engine.engine.batch(draft_len=engine.draft_len, sampling=Sampling(key[0], key[1], seed),
                                         on_tokens=self._on_tokens)
        self.jobs: dict[int, Job] = {}
        self._next = 0
        self.stopped: set[int] = set()          # keys whose stop string was reached in the last callback round

    def _on_tokens(self, key: int, toks: list[int]) -> None:
        self.metrics("output_tokens", len(toks))
        if self.jobs[key].push(toks):
            self.stopped.add(key)

    @property
    def live(self) -> int:
        return self.batch.live

    def add(self, jobs: list[Job]) -> None:
        t = now_ns()
        for j in jobs:
            j.scheduled_ns = t
        if self.batch.live:
            self.metrics("requests_joined_running_batch", len(jobs))
        keys = [self._next + i for i in range(len(jobs))]
        self._next += len(jobs)
        for k, j in zip(keys, jobs, strict=True):        # registered first: the prefill emits their first tokens
            self.jobs[k] = j
        try:
            self.batch.add([j.req.prompt_ids for j in jobs], max_new_tokens=[j.req.max_tokens for j in jobs],
                           eos_token_id=self.engine.eos_token_ids, keys=keys)
        except Exception:
            for k in keys:                  # the running rows are untouched; these jobs get the error
                self.jobs.pop(k, None)
            raise
        self._settle()

    def step(self) -> None:
        b = self.batch
        before = (b.stats.drafted, b.stats.accepted, b.stats.steps)
        rows = b.live
        b.step()
        self.metrics("target_forwards", 1)
        self.metrics("decode_rows", rows)
        if self.engine.draft_len:
            self.metrics("draft_tokens", b.stats.drafted - before[0])
            self.metrics("accepted_draft_tokens", b.stats.accepted - before[1])
            self.metrics("verification_steps", b.stats.steps - before[2])
        self._settle()

    def cancel(self, keys: list[int]) -> None:
        self.batch.cancel(keys)
        self._settle()

    def _settle(self) -> None:
        """Stop-string rows leave the batch; every finished row's job gets its result."""
        if self.stopped:
            self.batch.cancel([k for k in self.stopped if k in self.batch.keys()])
            self.stopped.clear()
        for key in list(self.batch.finished):
            req = self.batch.finished.pop(key)
            job = self.jobs.pop(key)
            finish = req.finish
            if job.stop_hit is not None:
                finish = "stop"
            # counted first: finish() hands the response to the client, who may read /metrics at once
            self.metrics("requests_cancelled" if finish == "cancelled" else "requests_completed", 1)
            job.finish(finish, req.stats, self.batch.k)

    def fail_all(self, error: BaseException) -> None:
        for job in self.jobs.values():
            self.metrics("requests_failed", 1)
            job.fail(error)
        self.jobs.clear()


def run_alone(engine: TextEngine, job: Job) -> None:
    """One job on a batch of its own, in this thread: `TextEngine.complete`."""
    g = Group(engine, job.req.sampling_key, job.req.seed, lambda *_: None)
    try:
        g.add([job])
        while g.live:
            g.step()
    except Exception as e:  # noqa: BLE001 - reported through the job
        if not job.done.is_set():
            job.fail(e)


def first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    hits = [(text.find(s), s) for s in stops if s in text]
    return min(hits) if hits else None


def now_ns() -> int:
    return time.time_ns()
