"""The server engines' driver (`data.regenerate.engine: endpoint`, and the vLLM runtime/data/regen_engines.py starts
for the job): `concurrency` worker threads take the unanswered prompts of the plan as they free up (nothing queued up
front), ask the completions client (runtime/data/endpoint_client.py, which retries), and hand each answer to the main
thread, which appends it to the journal (runtime/data/answers.py), counts retries and failures, draws the progress
(answered, retried, failed, tokens/s, ETA) and decides when failures end the run."""
from __future__ import annotations

import contextlib
import queue
import threading
import time
from dataclasses import dataclass

from runtime.data.answers import AnswerLog
from runtime.data.endpoint_client import CompletionsPool, EndpointError, FatalAnswer, RequestFailed, Stopped
from runtime.data.regenerate import Decoding, RegenRun


def cut_at_stop(ids: list[int], stop_ids) -> list[int]:
    """`ids` up to and including the first stop id."""
    stop = set(stop_ids)
    for i, t in enumerate(ids):
        if t in stop:
            return ids[: i + 1]
    return list(ids)


@dataclass
class ServerJob:
    """What a server engine needs beside the plan: the client, the plan's batch size (request i of batch b is seeded
    `seed + b * batch_size + i`), how to re-tokenize a text answer (`tok`, `end_id`: the id a text answer that stopped
    at a stop id gets back), and the share of prompts allowed to fail every attempt (`max_failed_fraction`)."""

    client: CompletionsPool
    batch_size: int
    tok: object = None
    end_id: int | None = None
    kind: str = "endpoint"
    detail: str = ""
    max_failed_fraction: float = 0.0


def _answer(job: ServerJob, prompt: list[int], seed: int, sampling: dict, stop_ids: list[int],
            on_retry=None) -> tuple[list[int], bool]:
    ids, text, reason = job.client.complete(prompt, seed=seed, stop_ids=stop_ids, on_retry=on_retry, **sampling)
    if ids is not None:
        return cut_at_stop(ids, stop_ids), False
    if job.tok is None:
        raise FatalAnswer(f"{job.client.url} returned text without token ids and no tokenizer was given")
    ids = job.tok(text, add_special_tokens=False)["input_ids"]
    if reason == "stop" and job.end_id is not None:
        ids.append(job.end_id)
    return cut_at_stop(ids, stop_ids), True


LOG_EVERY_S = 30.0      # a progress log line at most this far apart (answered, retried, failed, tokens/s, ETA)
BAR_EVERY_S = 0.25      # the progress bar redrawn at most this often
SHOW_RETRIES = 5        # retries logged one by one; the rest are counted in the progress lines


class _Tally:
    """The counters of a server regeneration, its progress bar and its log lines."""

    def __init__(self, job: ServerJob, total: int, resumed: int, run: RegenRun, bar):
        self.job, self.total, self.resumed, self.log, self.bar = job, total, resumed, run.log, bar
        self.answered = self.failed = self.retried = self.new_tokens = self.retok = self.failures_in_row = 0
        self.failed_keys: list[str] = []
        self.last_error: str | None = None
        self.t0 = self._bar_t = self._log_t = time.perf_counter()
        self._bar_n = 0
        self._lock = threading.Lock()

    def on_retry(self, err) -> None:        # called from the workers
        with self._lock:
            self.retried += 1
            n = self.retried
        if n <= SHOW_RETRIES:
            self.log.warning("regeneration: retrying (%s)%s", str(err)[:300],
                             "; further retries are counted in the progress lines" if n == SHOW_RETRIES else "")

    def ok(self, ids: list[int], retok: bool) -> None:
        self.answered += 1
        self.new_tokens += len(ids)
        self.retok += retok
        self.failures_in_row = 0

    def fail(self, key: str, err) -> None:
        self.failed += 1
        self.failures_in_row += 1
        self.last_error = str(err.last)[:1000]
        if len(self.failed_keys) < 20:
            self.failed_keys.append(key)
        self.log.warning("regeneration: prompt %s failed every attempt (%s)", key, str(err)[:300])

    def tick(self, final: bool = False) -> None:
        now = time.perf_counter()
        done = self.answered + self.failed
        if self.bar is not None and (final or now - self._bar_t >= BAR_EVERY_S):
            self.bar.update(done - self._bar_n, **self.fields(now))
            self._bar_n, self._bar_t = done, now
        if not final and now - self._log_t >= LOG_EVERY_S:
            self._log_t = now
            f = self.fields(now)
            self.log.info("regeneration: %d/%d answered (%d resumed), %d retried, %d failed, %s new tokens/s, ETA %s",
                          self.resumed + self.answered, self.total, self.resumed, self.retried, self.failed, f["tok_s"],
                          f["eta"])

    def fields(self, now: float) -> dict:
        dt = max(now - self.t0, 1e-9)
        done = self.answered + self.failed
        left = self.total - self.resumed - done
        eta = _hms(left * dt / done) if done else "-"
        return {"answered": self.resumed + self.answered, "retried": self.retried, "failed": self.failed,
                "tok_s": f"{self.new_tokens / dt:.1f}", "eta": eta}


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _worker(job: ServerJob, prompts, feed, out: queue.SimpleQueue, call: tuple) -> None:
    """Take the next (prompt index, batch, seed) from `feed` until it is empty or the run stops; put (j, b, answer,
    error) on `out`, then None."""
    sampling, stop_ids, on_retry = call
    stop = job.client.stop
    try:
        while not stop.is_set():
            item = feed()
            if item is None:
                break
            j, b, seed = item
            try:
                out.put((j, b, _answer(job, prompts[j], seed, sampling, stop_ids, on_retry), None))
            except Stopped:
                break
            except BaseException as e:  # noqa: BLE001 - handed to the main thread, which decides
                out.put((j, b, None, e))
    finally:
        out.put(None)


def _feeder(job: ServerJob, todo: list, results: list, seed: int):
    """A thread-safe `next()` over the unanswered prompts in plan order: requests are fed as capacity frees."""
    items = ((j, b, seed + b * job.batch_size + i) for b, idx in todo for i, j in enumerate(idx) if results[j] is None)
    lock = threading.Lock()

    def feed():
        with lock:
            return next(items, None)
    return feed


def server_batches(job: ServerJob, prompts: list[list[int]], keys: list[str], todo: list, results: list, *, resumed: int,
                   decoding: Decoding, run: RegenRun) -> dict:
    """`regenerate`'s driver for completions servers: `job.client.s.concurrency` workers take the unanswered prompts
    of `todo` in plan order as they free up (nothing queued up front), each answer appended to `run.answers` as it
    arrives; retries inside the client, failures counted (the run stops when `max(8, 2 x concurrency)` requests in a
    row failed every attempt, or at a fatal answer); at the end more failed prompts than `max_failed_fraction` allows
    fail the regeneration (the answers stay in the journal for a rerun)."""
    d, client, answers = decoding, job.client, run.answers or AnswerLog(None, keys)
    pending = sum(1 for _, idx in todo for j in idx if results[j] is None)
    left = {b: sum(1 for j in idx if results[j] is None) for b, idx in todo}
    bars = run.progress(total=len(prompts), desc=f"regenerate through {job.kind}") if run.progress else contextlib.nullcontext()
    client.stop.clear()
    with bars as bar:
        if resumed and run.progress:
            bar.update(resumed)
        tally = _Tally(job, len(prompts), resumed, run, bar if run.progress else None)
        out: queue.SimpleQueue = queue.SimpleQueue()
        call = ({"max_tokens": d.max_new_tokens, "temperature": d.temperature, "top_p": d.top_p}, d.stop_ids, tally.on_retry)
        feed, alive = _feeder(job, todo, results, d.seed), min(client.s.concurrency, pending)
        for _ in range(alive):
            threading.Thread(target=_worker, args=(job, prompts, feed, out, call), daemon=True).start()
        try:
            alive = _collect(job, keys, results, answers, out, alive, tally, _batch_counter(left, run.on_batch))
        finally:
            client.stop.set()       # workers stop after their request (daemons: an interrupt does not wait for them)
        tally.tick(final=True)
    _check_failures(job, tally, len(prompts), answers)
    return {"load_s": 0.0, "gen_s": time.perf_counter() - tally.t0, "new_tokens": tally.new_tokens, "padded": 0,
            "generated": tally.answered, "retokenized": tally.retok, "engine": job.kind, "detail": job.detail,
            **_failure_stats(job, tally, len(prompts))}


def _batch_counter(left: dict, on_batch):
    """`answered(b)`: one more prompt of batch b settled; `on_batch(n)` when it completes the n-th batch (fault points)."""
    done = [0]

    def answered(b: int) -> None:
        left[b] -= 1
        if left[b] == 0:
            done[0] += 1
            if on_batch is not None:
                on_batch(done[0])
    return answered


def _collect(job: ServerJob, keys, results, answers: AnswerLog, out: queue.SimpleQueue, alive: int, tally: _Tally,
             settled) -> int:
    """The main thread's loop: answers into `results` and the journal, failures counted, progress drawn."""
    abort_after = max(8, 2 * job.client.s.concurrency)
    while alive:
        try:
            msg = out.get(timeout=0.5)
        except queue.Empty:
            tally.tick()
            continue
        if msg is None:
            alive -= 1
            continue
        j, b, got, err = msg
        if err is None:
            ids, retok = got
            results[j] = ids
            answers.append(j, ids)
            tally.ok(ids, retok)
        elif isinstance(err, RequestFailed):
            tally.fail(keys[j], err)
            if tally.failures_in_row >= abort_after:
                raise EndpointError(f"{tally.failures_in_row} requests in a row failed every one of their "
                                    f"{job.client.s.max_attempts} attempts: the endpoints ({job.client.url}) look down; "
                                    f"last error: {tally.last_error}; {_kept(tally, answers)}")
        elif isinstance(err, EndpointError):
            raise EndpointError(f"{err} (prompt {keys[j]}); {_kept(tally, answers)}") from None
        else:
            raise err
        settled(b)
        tally.tick()
    return alive


def _kept(tally: _Tally, answers: AnswerLog) -> str:
    where = f"in {answers.path}" if answers.path is not None else "nowhere (no scratch)"
    return f"the {tally.resumed + tally.answered} answers so far are kept {where}: a rerun asks only for the rest"


def _failure_stats(job: ServerJob, tally: _Tally, total: int) -> dict:
    return {"failed_prompts": tally.failed, "failed_fraction": round(tally.failed / total, 6) if total else 0.0,
            "max_failed_fraction": job.max_failed_fraction, "failed_examples": tally.failed_keys,
            "last_error": tally.last_error, "retried_requests": tally.retried, "concurrency": job.client.s.concurrency,
            "endpoints": {e.url: e.counts() for e in job.client.endpoints}}


def _check_failures(job: ServerJob, tally: _Tally, total: int, answers: AnswerLog) -> None:
    allowed = int(job.max_failed_fraction * total)
    if tally.failed > allowed:
        worst = max(job.client.endpoints, key=lambda e: e.failed_attempts)
        raise EndpointError(f"{tally.failed} of {total} prompts failed every one of their {job.client.s.max_attempts} "
                            f"attempts at {job.client.url} (data.regenerate.max_failed_fraction {job.max_failed_fraction:g} "
                            f"allows {allowed}); most failing endpoint {worst.url} ({worst.failed_attempts} failed "
                            f"attempts); last error: "
                            f"{tally.last_error}; {_kept(tally, answers)}")
    if tally.failed:
        tally.log.warning("regeneration: %d of %d prompts failed every attempt and are left out (max_failed_fraction %g "
                          "allows %d); last error: %s", tally.failed, total, job.max_failed_fraction, allowed,
                          tally.last_error)
