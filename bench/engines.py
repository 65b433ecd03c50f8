"""The deployed pair in every engine that runs here, side by side in one run, and serving under one load client.

Part 1 (`--parts decode`), per evaluation domain, the same prompts (the data stage's rendered `prompt_ids`), the
same number of new tokens (end of sequence ignored, so every engine produces exactly the same count), greedy, at
batch 1 (requests one after another) and batch 8 (8 requests at once):

- vLLM plain and speculative (`vllm serve` in its own environment, `runtime.vllm.engine`; the BF16 target and the
  exported speculators draft: vLLM on CPU cannot run the FP8 target, see docs/benchmarks.md);
- specpipe's runtime plain and speculative (`SpeculativeEngine`, the same BF16 target + the draft it was trained as);
- Hugging Face `generate` on the BF16 target.

Tokens/s per engine and mode, acceptance length (vLLM's spec-decode counters; the runtime's own count), and the
speedup of speculation in each engine.

Part 2 (`--parts serve`): `specpipe serve`'s Triton CPU repository against `vllm serve`, both speculative with the
exported draft length, one load client (this script: threads posting non-streaming requests, the same text prompts,
the same max tokens) at each concurrency: output tokens/s, request latency p50/p99, failed requests.

    OMP_NUM_THREADS=2 python bench/engines.py --workdir runs/smollm2_fp8_eagle3 --json engines.json
    python bench/engines.py --workdir RUN --parts serve --concurrency 1,4,16

Needs vLLM (SPECPIPE_VLLM_PYTHON or .venv-vllm, see README) for everything vLLM; the other rows run without it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--parts", default="decode,serve")
    ap.add_argument("--engines", default="vllm,runtime,hf", help="decode part: which engines")
    ap.add_argument("--prompts-per-domain", type=int, default=8)
    ap.add_argument("--domains", default=None, help="comma-separated; default all")
    ap.add_argument("--prompts-from", type=Path, default=None,
                    help="another run of the same target whose data stage has more evaluation prompts (default: --workdir)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--draft-len", type=int, default=None, help="default: the exported draft length")
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("--requests", type=int, default=32, help="serve part: requests per concurrency point")
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--vllm-fp8", action="store_true",
                    help="decode part: also vLLM plain on the deployed FP8 target (first domain only: slow on CPU)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    return ap.parse_args(argv)


# ---------------------------------------------------------------- the run's artifacts

def pair(workdir: Path) -> dict:
    """The BF16 target, the draft it was trained as (ModelOpt export), the speculators draft and the exported k."""
    arts = workdir / "artifacts"
    q = json.loads((arts / "quantize" / "quantize.json").read_text())
    spec_dir = arts / "export" / "speculators"
    if not (spec_dir / "config.json").exists():
        sys.exit(f"{workdir}: no speculators export ({spec_dir}); run `specpipe build <config>` first")
    sc = json.loads((spec_dir / "config.json").read_text())
    k = sc["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    return {"target": arts / "target" / "model", "draft": arts / "train_draft" / "draft", "speculators": spec_dir,
            "deployed_target": arts / q["target_dir"], "k": int(k), "algorithm": sc.get("speculators_model_type")}


def prompts(workdir: Path, per_domain: int, domains: str | None) -> dict[str, list]:
    from pipeline.artifacts.data import read_eval

    want = set(domains.split(",")) if domains else None
    return read_eval(workdir / "artifacts" / "data", domains=want, per_domain=per_domain)


def _chunks(xs: list, n: int) -> list[list]:
    return [xs[i:i + n] for i in range(0, len(xs), n)]


# ---------------------------------------------------------------- part 1: decoding per engine

def runtime_rows(p: dict, per_domain: dict, a: argparse.Namespace, k: int) -> list[dict]:
    """specpipe's runtime, plain and speculative, batch 1 and batch B."""
    from runtime.engine.speculative import SpeculativeEngine, load_pair

    model, draft = load_pair(p["target"], p["draft"])
    eng = SpeculativeEngine(model, draft)
    eng.generate([per_domain[next(iter(per_domain))][0].prompt_ids], max_new_tokens=4, draft_len=k)   # warm-up
    rows = []
    for domain, ps in per_domain.items():
        ids = [x.prompt_ids for x in ps]
        for b in a.batch_list:
            for mode, dl in (("plain", 0), ("speculative", k)):
                t0, toks, acc_steps, acc_toks = time.perf_counter(), 0, 0, 0
                for chunk in _chunks(ids, b):
                    g = eng.generate(chunk, max_new_tokens=a.max_new_tokens, draft_len=dl,
                                     eos_token_id=None)
                    toks += sum(len(t) for t in g.tokens)
                    if dl:
                        acc_steps += g.stats.steps
                        acc_toks += g.stats.steps + g.stats.accepted
                dt = time.perf_counter() - t0
                rows.append({"engine": "specpipe runtime", "domain": domain, "batch": b, "mode": mode,
                             "tokens": toks, "seconds": round(dt, 2), "tok_s": round(toks / dt, 1),
                             "acceptance_length": round(acc_toks / acc_steps, 3) if acc_steps else None})
    return rows


def hf_rows(p: dict, per_domain: dict, a: argparse.Namespace) -> list[dict]:
    """Hugging Face `generate` on the BF16 target (left-padded batches), greedy, exactly max_new_tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(p["target"], dtype=torch.float32).eval()
    pad = m.config.eos_token_id if isinstance(m.config.eos_token_id, int) else (m.config.eos_token_id or [0])[0]
    rows = []
    for domain, ps in per_domain.items():
        ids = [x.prompt_ids for x in ps]
        for b in a.batch_list:
            t0, toks = time.perf_counter(), 0
            for chunk in _chunks(ids, b):
                L = max(len(x) for x in chunk)
                x = torch.tensor([[pad] * (L - len(c)) + c for c in chunk])
                mask = torch.tensor([[0] * (L - len(c)) + [1] * len(c) for c in chunk])
                with torch.no_grad():
                    y = m.generate(x, attention_mask=mask, max_new_tokens=a.max_new_tokens,
                                   min_new_tokens=a.max_new_tokens, do_sample=False, pad_token_id=pad)
                toks += (y.shape[1] - L) * len(chunk)
            dt = time.perf_counter() - t0
            rows.append({"engine": "HF generate", "domain": domain, "batch": b, "mode": "plain", "tokens": toks,
                         "seconds": round(dt, 2), "tok_s": round(toks / dt, 1), "acceptance_length": None})
    return rows


def vllm_rows(p: dict, per_domain: dict, a: argparse.Namespace, k: int) -> tuple[list[dict], dict]:
    """vLLM plain, then speculative (one server each), batch b = b concurrent requests. Returns (rows, the servers'
    argv and versions)."""
    from runtime.vllm.engine import ServeArgs, VllmServer, find_vllm

    inst = find_vllm(a.vllm_python)
    rows, info = [], {"vllm_version": inst.version, "device": inst.device, "argv": {}}
    modes = ["plain", "speculative"] + (["plain, FP8 target"] if a.vllm_fp8 else [])
    for mode in modes:
        spec = dict(draft=str(p["speculators"]), num_speculative_tokens=k) if mode == "speculative" else {}
        fp8 = mode.endswith("FP8 target")
        srv = VllmServer(inst, ServeArgs(str(p["deployed_target" if fp8 else "target"]), max_model_len=2048, **spec))
        info["argv"][mode] = srv.argv
        with srv.start():
            srv.generate([per_domain[next(iter(per_domain))][0].prompt_ids], max_tokens=4)    # warm-up
            for domain, ps in list(per_domain.items())[:1 if fp8 else None]:
                ids = [x.prompt_ids for x in ps]
                for b in a.batch_list:
                    c0 = srv.spec_decode()
                    t0 = time.perf_counter()
                    outs = srv.generate(ids, max_tokens=a.max_new_tokens, concurrency=b, ignore_eos=True)
                    dt = time.perf_counter() - t0
                    c1 = srv.spec_decode()
                    al = (c1 - c0).acceptance_length if (c0 is not None and c1 is not None) else None
                    toks = sum(len(o) for o in outs)
                    rows.append({"engine": f"vLLM {inst.version}", "domain": domain, "batch": b, "mode": mode,
                                 "tokens": toks, "seconds": round(dt, 2), "tok_s": round(toks / dt, 1),
                                 "acceptance_length": round(al, 3) if al == al and al is not None else None})
    return rows, info


def decode_table(rows: list[dict]) -> str:
    """Markdown: one line per engine/batch/mode, all domains pooled (tokens / seconds), and speculation's speedup."""
    key = lambda r: (r["engine"], r["batch"], r["mode"])   # noqa: E731
    pooled: dict[tuple, dict] = {}
    for r in rows:
        d = pooled.setdefault(key(r), {"tokens": 0, "seconds": 0.0, "al": []})
        d["tokens"] += r["tokens"]
        d["seconds"] += r["seconds"]
        if r["acceptance_length"]:
            d["al"].append(r["acceptance_length"])
    out = ["| engine | batch | mode | tok/s | AL (mean over domains) | speculative / plain |", "|---|---|---|---|---|---|"]
    for (eng, b, mode), d in pooled.items():
        tps = d["tokens"] / d["seconds"]
        plain = pooled.get((eng, b, "plain"))
        sp = f"{tps / (plain['tokens'] / plain['seconds']):.2f}x" if mode == "speculative" and plain else ""
        al = f"{statistics.mean(d['al']):.2f}" if d["al"] else ""
        out.append(f"| {eng} | {b} | {mode} | {tps:.1f} | {al} | {sp} |")
    return "\n".join(out)


# ---------------------------------------------------------------- part 2: serving under one load client

def _post(url: str, body: dict, timeout: float = 600) -> dict:
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def load(send, texts: list[str], concurrency: int, requests: int, count_tokens) -> dict:
    """`requests` requests (the texts in turn) from `concurrency` threads; throughput and latency."""
    lat, toks, failed, lock, errors = [], [0], [0], threading.Lock(), []

    def one(i: int) -> None:
        t0 = time.perf_counter()
        try:
            n = count_tokens(send(texts[i % len(texts)]))
        except Exception as e:   # noqa: BLE001 - a failed request is counted (its first error kept), not fatal
            with lock:
                failed[0] += 1
                errors.append(f"{type(e).__name__}: {getattr(e, 'read', lambda: b'')()[:300]!r} {e}"[:500])
            return
        with lock:
            lat.append(time.perf_counter() - t0)
            toks[0] += n

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        list(ex.map(one, range(requests)))
    wall = time.perf_counter() - t0
    q = statistics.quantiles(lat, n=100) if len(lat) > 1 else (lat * 99 or [float("nan")] * 99)
    return {"concurrency": concurrency, "requests": requests, "failed": failed[0], "tokens": toks[0],
            "tok_s": round(toks[0] / wall, 1), "latency_p50_s": round(q[49], 3), "latency_p99_s": round(q[98], 3),
            "first_error": errors[0] if errors else None}


def serve_rows(p: dict, workdir: Path, a: argparse.Namespace, k: int) -> list[dict]:
    """Triton (the exported CPU repository, non-decoupled, k) and vLLM (BF16 target + speculators draft, k), each
    driven by `load` at every concurrency with the same text prompts."""
    from transformers import AutoTokenizer

    from pipeline.artifacts.data import read_eval
    from runtime.serving import triton_server
    from runtime.vllm.engine import ServeArgs, VllmServer, find_vllm

    tok = AutoTokenizer.from_pretrained(p["target"])
    texts = [x.prompt for ps in read_eval(workdir / "artifacts" / "data").values() for x in ps]
    conc = [int(c) for c in a.concurrency.split(",")]
    rows = []
    repo = workdir / "artifacts" / "export" / "triton_cpu"
    params = {"specpipe_max_batch": str(max(conc)), "specpipe_max_queue": str(4 * max(conc)), "specpipe_draft_len": str(k)}
    with triton_server.start(repo, load=triton_server.ModelLoad(parameters=params, decoupled=False), ready_timeout=300) as srv:
        url = f"http://{srv.http_url}/v2/models/{srv.loaded[0]}/generate"
        send = lambda t: _post(url, {"text_input": t, "sampling_param_max_tokens": a.max_new_tokens})   # noqa: E731
        count = lambda r: len(tok(r["text_output"], add_special_tokens=False)["input_ids"])   # noqa: E731
        for c in conc:
            rows.append({"server": "specpipe serve (Triton CPU)", **load(send, texts, c, a.requests, count)})
    inst = find_vllm(a.vllm_python)
    srv = VllmServer(inst, ServeArgs(str(p["target"]), draft=str(p["speculators"]), num_speculative_tokens=k,
                                     max_model_len=2048, served_model_name="pair"))
    with srv.start():
        send = lambda t: _post(f"{srv.url}/v1/completions", {"model": "pair", "prompt": t, "temperature": 0,   # noqa: E731
                                                             "max_tokens": a.max_new_tokens})
        count = lambda r: r["usage"]["completion_tokens"]   # noqa: E731
        for c in conc:
            rows.append({"server": f"vllm serve {inst.version}", **load(send, texts, c, a.requests, count)})
    return rows


def serve_table(rows: list[dict]) -> str:
    out = ["| server | concurrency | tok/s | latency p50 (s) | p99 (s) | failed |", "|---|---|---|---|---|---|"]
    out += [f"| {r['server']} | {r['concurrency']} | {r['tok_s']} | {r['latency_p50_s']} | {r['latency_p99_s']} | "
            f"{r['failed']} |" for r in rows]
    return "\n".join(out)


def main(argv=None) -> int:
    a = parse_args(argv)
    from pipeline.commands import stop_signals

    stop_signals()   # `kill` stops the vLLM/Triton servers this run started, as Ctrl-C does
    import torch

    torch.set_num_threads(a.threads)
    a.batch_list = [int(b) for b in a.batches.split(",")]
    p = pair(a.workdir)
    k = a.draft_len or p["k"]
    per_domain = prompts(a.prompts_from or a.workdir, a.prompts_per_domain, a.domains)
    res: dict = {"command": " ".join(sys.argv), "workdir": str(a.workdir), "draft_len": k,
                 "prompts_from": str(a.prompts_from or a.workdir),
                 "max_new_tokens": a.max_new_tokens, "prompts_per_domain": a.prompts_per_domain, "decode": [], "serve": []}
    parts, engines = a.parts.split(","), a.engines.split(",")
    if "decode" in parts:
        if "vllm" in engines:
            rows, res["vllm"] = vllm_rows(p, per_domain, a, k)
            res["decode"] += rows
        if "runtime" in engines:
            res["decode"] += runtime_rows(p, per_domain, a, k)
        if "hf" in engines:
            res["decode"] += hf_rows(p, per_domain, a)
        print(decode_table(res["decode"]))
    if "serve" in parts:
        res["serve"] = serve_rows(p, a.workdir, a, k)
        print(serve_table(res["serve"]))
    if a.json:
        a.json.write_text(json.dumps(res, indent=2, default=str))
    return 1 if any(r["failed"] for r in res["serve"]) else 0


if __name__ == "__main__":
    sys.exit(main())
