"""The completions client of the server engines (`data.regenerate.engine: endpoint`, and the vLLM started for the job):
POST `<endpoint>/v1/completions` with token-id prompts on one endpoint or several sharing the load, over the standard
library's `http.client` (one keep-alive connection per worker thread and endpoint, socket timeouts, TLS verification
with an optional CA bundle), with the retries production clients make.

Why not httpx or the `openai` SDK: client CPU. Side by side on the same fake endpoint (bench/regen_scale.py,
docs/benchmarks.md), bare httpx costs 0.83-1.04 ms of CPU a request and bare `http.client` 0.22-0.24 ms, so the goal of
under 1 ms a request for the whole path (retries, journal, progress) is out of reach on httpx; the SDK is built on
httpx and parses every answer into pydantic objects on top. Their retries would not have been enough either: httpx
retries only connection failures (httpcore 1.0.9, httpcore/_sync/connection.py: `retries` catches
ConnectError/ConnectTimeout alone), while a shared endpoint answers 429/503 under load, drops connections when it
restarts and stalls. Not supported here: HTTP proxies from the environment (HTTP(S)_PROXY), HTTP/2.

A request is retried on HTTP 408, 429 and 5xx, on any transport error (connection refused or reset, a body cut
short) and on a timeout (`timeout_s`: connect, send and each read, as a socket timeout), up to `max_attempts`
attempts, after an exponential backoff with jitter (`backoff_s` x 2^(attempt-1), capped at BACKOFF_CAP_S, half of it
random) or the server's `Retry-After` when longer (capped at RETRY_AFTER_CAP_S). The endpoint that failed rests for
as long, and the retry goes to the next endpoint. Answers that cannot get better by asking again fail at once
(`FatalAnswer`): another 4xx, a body that is not the completions JSON, token ids outside the vocabulary, a TLS
certificate that is not trusted.
"""
from __future__ import annotations

import email.utils
import http.client
import itertools
import json
import random
import ssl
import threading
import time
import urllib.parse
from dataclasses import dataclass, field

from runtime.errors import RuntimeFailure

BACKOFF_CAP_S = 30.0
RETRY_AFTER_CAP_S = 300.0
RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504}) | frozenset(range(505, 600))


class EndpointError(RuntimeFailure):
    """The completions server failed a request or answered something this client cannot read."""


class FatalAnswer(EndpointError):
    """An answer that asking again cannot fix (4xx other than 408/429, malformed JSON, ids outside the vocabulary)."""


class Retryable(EndpointError):
    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


class RequestFailed(EndpointError):
    """A request that failed every one of its attempts (`last`: the last attempt's error)."""

    def __init__(self, attempts: int, last: Retryable):
        super().__init__(f"failed {attempts} attempts; last: {last}")
        self.last = last


class Stopped(Exception):
    """The run was stopped (Ctrl-C, SIGTERM, a fatal answer elsewhere) while this request waited to retry."""


@dataclass(frozen=True)
class ClientSettings:
    """How the server engines talk to their endpoints (data.regenerate: endpoint, api_key_env, headers, tls_verify,
    ca_bundle, concurrency, timeout_s, max_attempts, backoff_s). `api_key` is read from the environment variable the
    config names and never printed (repr=False)."""

    endpoints: tuple[str, ...]
    model: str | None = None
    api_key: str | None = field(default=None, repr=False)
    headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    verify: bool | str = True
    timeout_s: float = 600.0
    max_attempts: int = 6
    backoff_s: float = 0.5
    concurrency: int = 16
    vocab_size: int | None = None


def retry_after_s(value: str | None) -> float | None:
    """`Retry-After` (RFC 9110 10.2.3: delay-seconds or an HTTP-date) in seconds from now; None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time()) if when is not None else None


def backoff_delay(attempt: int, base: float, retry_after: float | None = None, rng=random) -> float:
    """Seconds to wait before attempt `attempt + 1`: exponential with equal jitter, or the server's Retry-After when longer."""
    cap = min(BACKOFF_CAP_S, base * 2 ** (attempt - 1))
    delay = cap / 2 + rng.uniform(0, cap / 2)
    return max(delay, min(retry_after, RETRY_AFTER_CAP_S)) if retry_after is not None else delay


class Endpoint:
    """One base URL and its counters; `rest_until`: not picked before this monotonic time."""

    def __init__(self, url: str):
        u = urllib.parse.urlsplit(url)
        self.url, self.https, self.host = url, u.scheme == "https", u.hostname or ""
        self.port, self.path = u.port or (443 if self.https else 80), u.path.rstrip("/")
        self.token_ids = True           # vLLM's `return_token_ids`; False after a server refused it (text answers)
        self.rest_until = 0.0
        self.requests = self.answered = self.failed_attempts = self.failures_in_row = 0
        self.last_error: str | None = None

    def counts(self) -> dict:
        return {"requests": self.requests, "answered": self.answered, "failed_attempts": self.failed_attempts,
                "last_error": self.last_error}


class CompletionsPool:
    """The endpoints of one regeneration, used round robin (skipping those resting after a failure). Thread-safe:
    the engine's workers share it, each thread keeping its own keep-alive connection to each endpoint. `complete`
    returns (generated ids or None where the server returned text only, text, finish_reason)."""

    def __init__(self, s: ClientSettings, stop: threading.Event | None = None):
        self.s, self.stop = s, stop or threading.Event()
        self.headers = {"Content-Type": "application/json", **dict(s.headers)}
        if s.api_key:
            self.headers["Authorization"] = f"Bearer {s.api_key}"
        self.ssl = None
        if any(u.startswith("https://") for u in s.endpoints):
            self.ssl = ssl.create_default_context(cafile=s.verify if isinstance(s.verify, str) else None)
            if s.verify is False:
                self.ssl.check_hostname, self.ssl.verify_mode = False, ssl.CERT_NONE
        self.endpoints = [Endpoint(u.rstrip("/")) for u in s.endpoints]
        self._rr = itertools.count()
        self._lock = threading.Lock()
        self._local = threading.local()
        self._open: list = []
        self.model = s.model or self.models()[0]

    @property
    def url(self) -> str:
        return ", ".join(e.url for e in self.endpoints)

    def close(self) -> None:
        with self._lock:
            conns, self._open = self._open, []
        for c in conns:
            c.close()

    def _pick(self) -> Endpoint:
        now = time.monotonic()
        with self._lock:
            eps = self.endpoints
            k = next(self._rr)
            for i in range(len(eps)):
                e = eps[(k + i) % len(eps)]
                if e.rest_until <= now:
                    break
            else:
                e = min(eps, key=lambda e: e.rest_until)
            e.requests += 1
            return e

    def _conn(self, e: Endpoint):
        conns = self._local.__dict__.setdefault("conns", {})
        c = conns.get(e.url)
        if c is None:
            c = (http.client.HTTPSConnection(e.host, e.port, timeout=self.s.timeout_s, context=self.ssl) if e.https else
                 http.client.HTTPConnection(e.host, e.port, timeout=self.s.timeout_s))
            conns[e.url] = c
            with self._lock:
                self._open.append(c)
        return c

    def _drop(self, e: Endpoint) -> None:
        c = self._local.__dict__.get("conns", {}).pop(e.url, None)
        if c is not None:
            c.close()

    def _once(self, e: Endpoint, path: str, body: bytes | None) -> dict:
        c = self._conn(e)
        try:
            c.request("POST" if body is not None else "GET", e.path + path, body=body, headers=self.headers)
            r = c.getresponse()
            content, status = r.read(), r.status
            retry_after = r.getheader("Retry-After")
            if r.will_close:
                self._drop(e)
        except ssl.SSLCertVerificationError as x:
            self._drop(e)
            raise FatalAnswer(f"{e.url}: the TLS certificate is not trusted ({x.verify_message}); set "
                              "data.regenerate.ca_bundle to the CA that signs it") from None
        except TimeoutError:
            self._drop(e)
            raise Retryable(f"{e.url}{path}: no answer within data.regenerate.timeout_s={self.s.timeout_s:g}s") from None
        except (OSError, http.client.HTTPException) as x:
            self._drop(e)
            raise Retryable(f"{e.url}{path}: {type(x).__name__}: {x}") from None
        if status != 200:
            msg = f"{e.url}{path} answered HTTP {status}: {content[:500].decode(errors='replace')}"
            if status in RETRYABLE_STATUS:
                raise Retryable(msg, retry_after_s(retry_after))
            raise FatalAnswer(msg)
        try:
            return json.loads(content)
        except ValueError:
            raise FatalAnswer(f"{e.url}{path} answered HTTP 200 with a body that is not JSON: "
                              f"{content[:300].decode(errors='replace')!r}") from None

    def _call(self, path: str, body: bytes | None, on_retry=None) -> tuple[dict, Endpoint]:
        last = None
        for attempt in range(1, self.s.max_attempts + 1):
            if self.stop.is_set():
                raise Stopped()
            e = self._pick()
            try:
                out = self._once(e, path, body)
            except Retryable as x:
                last = x
                delay = backoff_delay(attempt, self.s.backoff_s, x.retry_after)
                with self._lock:
                    e.failed_attempts += 1
                    e.failures_in_row += 1
                    e.last_error = str(x)[:500]
                    rest = backoff_delay(e.failures_in_row, self.s.backoff_s, x.retry_after)
                    e.rest_until = max(e.rest_until, time.monotonic() + rest)
                if attempt == self.s.max_attempts:
                    break
                if on_retry is not None:
                    on_retry(x)
                if self.stop.wait(delay):
                    raise Stopped() from None
                continue
            e.failures_in_row = 0
            return out, e
        raise RequestFailed(self.s.max_attempts, last)

    def models(self) -> list[str]:
        out, e = self._call("/v1/models", None)
        ids = [m.get("id") for m in (out.get("data") or []) if isinstance(m, dict) and m.get("id")] \
            if isinstance(out, dict) else []
        if not ids:
            raise EndpointError(f"{e.url}/v1/models lists no model ({str(out)[:300]}); set data.regenerate.endpoint_model")
        return ids

    def complete(self, prompt: list[int], *, max_tokens: int, temperature: float, top_p: float, seed: int | None,
                 stop_ids: list[int], on_retry=None) -> tuple[list[int] | None, str, str | None]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": int(max_tokens), "temperature": float(temperature),
                "top_p": float(top_p), "stop_token_ids": list(stop_ids)}
        if temperature > 0 and seed is not None:
            body["seed"] = int(seed)
        with_ids = dict(body, return_token_ids=True)
        while True:
            ask_ids = all(e.token_ids for e in self.endpoints)
            try:
                out, e = self._call("/v1/completions", json.dumps(with_ids if ask_ids else body).encode(), on_retry)
                break
            except FatalAnswer as x:
                if not (ask_ids and "return_token_ids" in str(x) and "HTTP 4" in str(x)):
                    raise
                for e in self.endpoints:      # a server that refuses vLLM's extra: text answers, re-tokenized
                    e.token_ids = False
        return self._read(e, out)

    def _read(self, e: Endpoint, out: dict) -> tuple[list[int] | None, str, str | None]:
        try:
            c = out["choices"][0]
            ids = c.get("token_ids")
            text = c.get("text") or ""
        except (KeyError, IndexError, TypeError, AttributeError):
            raise FatalAnswer(f"{e.url}/v1/completions: no choices in {str(out)[:300]}") from None
        if ids is not None:
            v = self.s.vocab_size
            if not isinstance(ids, list) or not all(type(t) is int and 0 <= t and (v is None or t < v) for t in ids):
                bad = next((t for t in (ids if isinstance(ids, list) else [ids])
                            if not (type(t) is int and 0 <= t and (v is None or t < v))), ids)
                raise FatalAnswer(f"{e.url}/v1/completions returned token id {bad!r}, not an id of the target's vocabulary "
                                  f"(0..{v - 1 if v else '?'}): is the endpoint serving another model?")
        with self._lock:
            e.answered += 1
        return ids, text, c.get("finish_reason")
