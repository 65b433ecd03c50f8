"""A fake OpenAI-compatible completions server (a real HTTP server in a thread, bound to 127.0.0.1) that misbehaves on
purpose: the regeneration client's fault-injection tests and bench/regen_scale.py drive it. It serves the shape the
client reads from vLLM v0.32.0 (vllm/entrypoints/openai/completion/protocol.py): GET /v1/models -> `data[i].id`;
POST /v1/completions with a token-id `prompt`, `max_tokens`, `stop_token_ids`, `seed`, `return_token_ids` ->
`choices[0].token_ids`, `text`, `finish_reason`.

The answer is a pure function of (prompt, seed, max_tokens, stop ids): `expected_answer`, so a test knows every right
answer. Faults hit a prompt's first request (the state is shared by the servers of one test): `faults` maps a mode to
the fraction of prompts it hits (by a hash of the prompt): 503, 429 (with Retry-After), `reset` (headers and half the
body, then a TCP reset), `hang` (no answer until `hang_s`, then the connection closed), `malformed` (HTTP 200, not
JSON), `bad_ids` (an id outside the vocabulary), `always503` (every request of that prompt). `die_after=N`: the server
stops after N answers (listening socket closed, open connections dropped).
"""
from __future__ import annotations

import collections
import json
import socket
import struct
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODES = ("503", "429", "reset", "hang", "malformed", "bad_ids", "always503")


def prompt_hash(prompt: list[int], seed: int | None = None) -> int:
    return zlib.crc32(struct.pack(f"{len(prompt)}i", *prompt)) ^ (seed or 0)


def expected_answer(prompt: list[int], max_tokens: int, stop_ids: list[int], vocab: int, seed: int | None = None) -> list[int]:
    """What the fake generates: 1..max_tokens ids of 3..vocab-1, then the first stop id when it stopped early."""
    h = prompt_hash(prompt, seed)
    n = 1 + h % max_tokens
    ids = [3 + (h + 7 * k) % (vocab - 3) for k in range(n)]
    return ids + [stop_ids[0]] if n < max_tokens and stop_ids else ids


class State:
    """Shared by the servers of one test: requests and complete answers per prompt, the fault plan."""

    def __init__(self, faults: dict[str, float] | None = None, vocab: int = 1000, retry_after: str = "1", hang_s: float = 2.0):
        self.faults, self.vocab, self.retry_after, self.hang_s = dict(faults or {}), vocab, retry_after, hang_s
        self.lock = threading.Lock()
        self.asked: collections.Counter = collections.Counter()
        self.answered: collections.Counter = collections.Counter()
        self.headers_seen: list[dict] = []
        self.faulted: collections.Counter = collections.Counter()

    def fault_for(self, prompt: list[int]) -> str | None:
        key = tuple(prompt)
        with self.lock:
            self.asked[key] += 1
            first = self.asked[key] == 1
        x, acc = (prompt_hash(prompt) >> 8) % 10_000 / 10_000, 0.0
        for mode in MODES:
            acc += self.faults.get(mode, 0.0)
            if x < acc:
                return mode if first or mode == "always503" else None
        return None


class FakeCompletions:
    """One endpoint. `url` after `start()`; `stop()` ends it (what a dying endpoint does)."""

    def __init__(self, state: State | None = None, *, model: str = "fake-target", api_key: str | None = None,
                 die_after: int | None = None, delay_s: float = 0.0, tls: tuple[str, str] | None = None):
        self.state = state or State()
        self.tls = tls          # (certificate file, key file): https
        self.model, self.api_key, self.die_after, self.delay_s = model, api_key, die_after, delay_s
        self.served = 0
        self.dead = False
        self.httpd: ThreadingHTTPServer | None = None

    def start(self) -> str:
        handler = type("Handler", (_Handler,), {"fake": self})
        self.httpd = _Server(("127.0.0.1", 0), handler)
        if self.tls:
            import ssl

            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(*self.tls)
            self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self.url

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.httpd.server_address[1]}"

    def stop(self) -> None:
        self.dead = True
        if self.httpd is not None:
            threading.Thread(target=self.httpd.shutdown, daemon=True).start()
            self.httpd.socket.close()

    def __enter__(self) -> FakeCompletions:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256

    def handle_error(self, request, client_address):     # the faults break connections on purpose
        pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    fake: FakeCompletions

    def log_message(self, *a):
        pass

    def _send(self, code: int, body: bytes, headers: dict | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def _drop(self) -> None:
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))   # close = TCP reset
        self.close_connection = True

    def _authorized(self) -> bool:
        key = self.fake.api_key
        if key is None or self.headers.get("Authorization") == f"Bearer {key}":
            return True
        self._send(401, b'{"error": "Unauthorized"}')
        return False

    def do_GET(self):
        if self.fake.dead:
            return self._drop()
        if not self._authorized():
            return None
        if self.path != "/v1/models":
            return self._send(404, b'{"error": "not found"}')
        return self._send(200, json.dumps({"object": "list", "data": [{"id": self.fake.model, "object": "model"}]}).encode())

    def do_POST(self):
        fake, st = self.fake, self.fake.state
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        if fake.dead:
            return self._drop()
        with st.lock:
            st.headers_seen.append({k.lower(): v for k, v in self.headers.items()})
        if not self._authorized():
            return None
        if self.path != "/v1/completions":
            return self._send(404, b'{"error": "not found"}')
        if body.get("model") != fake.model:
            return self._send(404, json.dumps({"error": f"model {body.get('model')} does not exist"}).encode())
        prompt = body["prompt"]
        mode = st.fault_for(prompt)
        if mode:
            with st.lock:
                st.faulted[mode] += 1
        if fake.delay_s:
            time.sleep(fake.delay_s)
        ids = expected_answer(prompt, body["max_tokens"], body.get("stop_token_ids") or [], st.vocab, body.get("seed"))
        if mode == "bad_ids":
            ids = [*ids[:-1], st.vocab + 5]
        stopped = len(ids) < body["max_tokens"] or bool(set(ids) & set(body.get("stop_token_ids") or []))
        out = json.dumps({"id": "cmpl-fake", "object": "text_completion", "model": fake.model,
                          "choices": [{"index": 0, "text": "", "token_ids": ids if body.get("return_token_ids") else None,
                                       "finish_reason": "stop" if stopped else "length"}],
                          "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids)}}).encode()
        return self._answer(mode, out, tuple(prompt))

    def _answer(self, mode: str | None, out: bytes, key: tuple) -> None:
        fake, st = self.fake, self.fake.state
        if mode in ("503", "always503"):
            return self._send(503, b'{"error": "Service Unavailable: overloaded"}')
        if mode == "429":
            return self._send(429, b'{"error": "Too Many Requests"}', {"Retry-After": st.retry_after})
        if mode == "hang":
            time.sleep(st.hang_s)
            return self._drop()
        if mode == "reset":
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out[: len(out) // 2])
            self.wfile.flush()
            return self._drop()
        if mode == "malformed":
            return self._send(200, b'{"id": "cmpl-fake", "choices": [{"token_ids": [1, 2')
        self._send(200, out)
        with st.lock:
            st.answered[key] += 1
            fake.served += 1
            dying = fake.die_after is not None and fake.served >= fake.die_after
        if dying:
            fake.stop()
        return None
