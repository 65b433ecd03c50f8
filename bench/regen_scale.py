"""Regeneration at scale through the endpoint engine's client: N prompts (default 100,000) against fast local fake
completions endpoints (tests/support/fake_completions.py, each in its own process, so this process's CPU is the
client's alone), the path `data.regenerate.engine: endpoint` runs (`regenerate` -> `server_batches` -> the retrying
client, every answer appended to the journal, progress lines), and side by side in the same run the
floors: the same requests posted by bare `http.client` connections (the transport the engine uses) and by bare httpx
clients from the same number of threads (no retries, journal, progress; json.loads of the answer only).

Reported: client CPU per request (user + system of this process over the run, all threads), the stage's own
overhead per 1,000 answers (full path minus the bare `http.client` floor), wall time and answers/s, peak RSS, and RSS
sampled at each 10 % of the run (flat apart from the answers kept: their own size is printed beside it).

    nice python bench/regen_scale.py --prompts 100000 --concurrency 32 --endpoints 2 --json regen_scale.json
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

SERVE = """
import sys, time
sys.path[:0] = [{repo!r}, {tests!r}]
from support.fake_completions import FakeCompletions, State
f = FakeCompletions(State(vocab=32000))
print(f.start(), flush=True)
while True:
    time.sleep(3600)
"""


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=100_000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--endpoints", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--floor-prompts", type=int, default=20_000, help="requests of the bare-httpx floor")
    ap.add_argument("--json", type=Path)
    return ap.parse_args(argv)


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def start_servers(n: int) -> tuple[list[subprocess.Popen], list[str]]:
    procs, urls = [], []
    for _ in range(n):
        p = subprocess.Popen([sys.executable, "-c", SERVE.format(repo=str(REPO), tests=str(REPO / "tests"))],
                             stdout=subprocess.PIPE, text=True)
        procs.append(p)
        urls.append(p.stdout.readline().strip())
    return procs, urls


def make_prompts(n: int) -> tuple[list[list[int]], list[str]]:
    return [[1 + (i * 31 + k) % 31000 for k in range(16 + i % 48)] for i in range(n)], [f"s{i:07d}" for i in range(n)]


class RssAtProgress(logging.Handler):
    """Samples RSS every time the progress bar logs (each 10 %) and at each of the regeneration's log lines."""

    def __init__(self):
        super().__init__()
        self.samples: list[tuple[str, float]] = []

    def emit(self, record):
        msg = record.getMessage()
        if msg.startswith("regenerate through"):
            self.samples.append((msg.split()[3], round(rss_mb(), 1)))


def full_path(a, urls, prompts, keys, scratch: Path) -> dict:
    from pipeline.progress import Progress
    from runtime.data import endpoint_client as C
    from runtime.data import server_engine as S
    from runtime.data.regenerate import Decoding, RegenRun, regenerate

    log = logging.getLogger("bench.regen_scale")
    log.setLevel(logging.INFO)
    probe = RssAtProgress()
    log.addHandler(probe)
    pool = C.CompletionsPool(C.ClientSettings(tuple(urls), concurrency=a.concurrency, timeout_s=60, vocab_size=32000))
    job = S.ServerJob(pool, 16)
    rss0, cpu0, t0 = rss_mb(), cpu_s(), time.perf_counter()
    res, st = regenerate(Path("/unused"), prompts, keys, batch_size=16,
                         decoding=Decoding(a.max_new_tokens, 0.0, 1.0, [2], 0),
                         run=RegenRun(scratch, log, lambda total, desc: Progress(log, total=total, desc=desc)),
                         generate_batches=lambda *x, **k: S.server_batches(job, *x, **k))
    cpu, wall = cpu_s() - cpu0, time.perf_counter() - t0
    pool.close()
    # what the answers themselves hold: per list its object (56 B + the 16 B GC header) and item array (8 B a slot), per
    # id above 256 (below: shared small ints) an int of 28 B; pymalloc rounds each block up to 16 B
    answers_mb = sum(80 + -(-8 * len(t) // 16) * 16 + 32 * sum(1 for x in t if x > 256) for t in res) / 2**20
    assert st["generated_prompts"] == len(prompts) and st["failed_prompts"] == 0
    return {"prompts": len(prompts), "cpu_s": round(cpu, 2), "wall_s": round(wall, 2),
            "cpu_ms_per_request": round(1000 * cpu / len(prompts), 4), "answers_per_s": round(len(prompts) / wall, 1),
            "rss_start_mb": round(rss0, 1), "rss_end_mb": round(rss_mb(), 1), "answers_mb": round(answers_mb, 1),
            "rss_at_progress_mb": probe.samples, "journal_mb": round((scratch / "answers.jsonl").stat().st_size / 2**20, 1),
            "new_tokens": st["new_tokens"]}


def floor(a, urls, prompts, kind: str) -> dict:
    """The same requests from bare clients in as many threads (`kind`: `http.client`, one keep-alive connection per
    thread and endpoint, the transport the engine uses; or `httpx`, one pooled client per endpoint): what the HTTP
    client alone costs."""
    import http.client

    import httpx

    it, lock = iter(range(len(prompts))), threading.Lock()
    pools = [httpx.Client(limits=httpx.Limits(max_connections=a.concurrency)) for _ in urls] if kind == "httpx" else None
    hosts = [u[len("http://"):].split(":") for u in urls]

    def work():
        conns = [http.client.HTTPConnection(h, int(p), timeout=60) for h, p in hosts]
        while True:
            with lock:
                j = next(it, None)
            if j is None:
                return
            body = json.dumps({"model": "fake-target", "prompt": prompts[j], "max_tokens": a.max_new_tokens,
                               "temperature": 0.0, "top_p": 1.0, "stop_token_ids": [2], "return_token_ids": True}).encode()
            e = j % len(urls)
            if pools is not None:
                content = pools[e].post(urls[e] + "/v1/completions", content=body,
                                        headers={"Content-Type": "application/json"}).content
            else:
                conns[e].request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
                content = conns[e].getresponse().read()
            json.loads(content)

    cpu0, t0 = cpu_s(), time.perf_counter()
    threads = [threading.Thread(target=work) for _ in range(a.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cpu, wall = cpu_s() - cpu0, time.perf_counter() - t0
    for c in pools or []:
        c.close()
    return {"prompts": len(prompts), "cpu_s": round(cpu, 2), "wall_s": round(wall, 2),
            "cpu_ms_per_request": round(1000 * cpu / len(prompts), 4)}


def main(argv=None) -> None:
    a = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    procs, urls = start_servers(a.endpoints)
    try:
        prompts, keys = make_prompts(a.prompts)
        fl = floor(a, urls, prompts[: a.floor_prompts], "http.client")
        fx = floor(a, urls, prompts[: a.floor_prompts], "httpx")
        with tempfile.TemporaryDirectory() as tmp:
            full = full_path(a, urls, prompts, keys, Path(tmp))
    finally:
        for p in procs:
            p.kill()
    out = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}, "full": full,
           "http_client_floor": fl, "httpx_floor": fx,
           "stage_overhead_ms_per_1000": round(1000 * (full["cpu_ms_per_request"] - fl["cpu_ms_per_request"]), 1),
           "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
           "load_1m": os.getloadavg()[0]}
    print(json.dumps(out, indent=2))
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
