"""`specpipe serve` under load, measured by a client nobody here wrote: Triton's perf_analyzer (tritonclient 2.51).

For each mode (speculative: the exported draft length; plain: the same FP8 target, draft length 0) and protocol
(gRPC with streaming, one response per decoding step; HTTP `infer`, one response per request, which needs the
model loaded non-decoupled) a real Triton server is started on the run's CPU repository, and perf_analyzer
drives it at each concurrency with the run's evaluation prompts (greedy). From perf_analyzer's profile export
(every request's send time, every response's time and text) this reports:

- throughput: output tokens / wall time of the measured requests;
- time per output token (TPOT) p50 / p99 over requests: streaming (last response - first response) / (tokens - 1);
  HTTP (response - request) / tokens (includes the prefill: one response);
- TTFT p50 (streaming): first response - request;
- rows per target forward and AL, from the model's Prometheus counters over the run;
- lost responses (requests without a final response) and greedy mismatches: every response's text must equal
  the in-process `SpeculativeEngine.generate` output for the same prompt (and draft length).

It prints a markdown table ready for docs/benchmarks.md, with the command. Exit code 1 if anything was lost or
differs. perf_analyzer needs Debian's libb64-0d and PyPI's nvidia-cuda-runtime-cu12 (libcudart.so.12, found
through the installed package; no GPU needed).

    OMP_NUM_THREADS=1 python bench/serve_load.py --workdir runs/tiny_fp8_eagle3
    python bench/serve_load.py --workdir RUN --concurrency 1,2 --requests 8 --stability 1000   # a quick check
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def cudart_dir() -> str:
    import importlib.util

    spec = importlib.util.find_spec("nvidia.cuda_runtime")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("perf_analyzer needs libcudart.so.12: pip install nvidia-cuda-runtime-cu12")
    return str(Path(list(spec.submodule_search_locations)[0]) / "lib")


def perf_analyzer() -> str:
    exe = shutil.which("perf_analyzer") or str(Path(sys.executable).parent / "perf_analyzer")
    if not Path(exe).exists():
        sys.exit("perf_analyzer not found: pip install 'tritonclient[grpc,http]==2.51.0' (it ships the binary)")
    return exe


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    i = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[i]


def counters(metrics_url: str) -> dict[str, float]:
    with urllib.request.urlopen(metrics_url, timeout=10) as r:  # noqa: S310 - 127.0.0.1
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("specpipe_") and "_total{" in line and "outcome=" not in line:
            name = line.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", required=True, type=Path, help="a run with a committed export (CPU repository)")
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("--max-tokens", type=int, default=64, help="sampling_param_max_tokens of every request")
    ap.add_argument("--prompts", type=int, default=16, help="evaluation prompts to cycle through (all domains)")
    ap.add_argument("--requests", type=int, default=32, help="perf_analyzer --measurement-request-count")
    ap.add_argument("--stability", type=float, default=10.0, help="perf_analyzer --stability-percentage")
    ap.add_argument("--max-trials", type=int, default=10, help="perf_analyzer --max-trials (at least 3: it compares 3 windows)")
    ap.add_argument("--modes", default="speculative,plain")
    ap.add_argument("--protocols", default="grpc,http")
    ap.add_argument("--out", type=Path, default=None, help="where the profiles and results.json go (default: a temp dir)")
    return ap.parse_args()


def exported_model(workdir: Path) -> tuple[Path, Path, dict]:
    """(the CPU repository, its model version directory, specpipe_model.json) of the run's export."""
    repo = workdir / "artifacts" / "export" / "triton_cpu"
    model_dir = repo / "tensorrt_llm" / "1"
    if not (model_dir / "specpipe_model.json").exists():
        sys.exit(f"{workdir}: no exported CPU repository ({repo}); run `specpipe build <config>` first")
    return repo, model_dir, json.loads((model_dir / "specpipe_model.json").read_text())


def eval_prompts(workdir: Path, n: int) -> list[str]:
    """The first `n` (at least 1) distinct evaluation prompts, every domain's in turn (domains sorted), through the
    data artifact's reader."""
    from pipeline.artifacts.data import read_eval
    from pipeline.errors import StageError

    try:
        per_domain = read_eval(workdir / "artifacts" / "data")
    except StageError as e:
        sys.exit(f"cannot read the evaluation prompts: {e}")
    prompts = [p.prompt for domain in per_domain.values() for p in domain]
    return list(dict.fromkeys(prompts))[:max(1, n)]


def measured_modes(a: argparse.Namespace, spec: dict) -> list[str]:
    """The --modes that can be measured: without an exported draft only plain (an error if that leaves nothing)."""
    wanted = a.modes.split(",")
    if not spec.get("draft") and "speculative" in wanted:
        # tune found that no draft length pays for this pair and export deployed the target alone
        if wanted == ["speculative"]:
            sys.exit(f"{a.workdir}: the exported pair does not speculate (tune turned speculation off: "
                     f"artifacts/tune/tuning.json); only --modes plain can be measured")
        print(f"{a.workdir}: the exported pair does not speculate (tune turned it off): measuring plain only")
        wanted = [m for m in wanted if m != "speculative"]
    return wanted


def reference_outputs(model_dir: Path, spec: dict, modes: list[str], prompts: list[str],
                      max_tokens: int) -> tuple[dict[str, int], dict[int, dict[str, tuple[str, int]]]]:
    """The draft length of each mode, and what every greedy response must be at each draft length measured: the
    runtime's own generate() on each prompt alone, as (text, tokens)."""
    from runtime.serving.adapter import ServingEngine

    ref = ServingEngine(model_dir / spec["target"], model_dir / spec["draft"] if spec.get("draft") else None,
                        draft_len=spec["draft_len"], eos_token_ids=spec.get("eos_token_ids"),
                        compute=spec.get("compute", "fp32"))
    draft_lens = {"speculative": ref.draft_len, "plain": 0}
    expected: dict[int, dict[str, tuple[str, int]]] = {}
    for k in {draft_lens[m] for m in modes}:
        expected[k] = {}
        for p in prompts:
            g = ref.engine.generate([ref.encode(p)], max_new_tokens=max_tokens, draft_len=k,
                                    eos_token_id=ref.eos_token_ids)
            expected[k][p] = (ref.decode(g.tokens[0]), len(g.tokens[0]))
    return draft_lens, expected


def write_input_data(out: Path, proto: str, prompts: list[str], max_tokens: int, streaming: bool) -> Path:
    """perf_analyzer's --input-data file: one request per prompt."""
    data = {"data": [{"text_input": {"content": [p], "shape": [1]},
                      "sampling_param_max_tokens": {"content": [max_tokens], "shape": [1]},
                      **({"streaming": {"content": [True], "shape": [1]}} if streaming else {})} for p in prompts]}
    data_f = out / f"input-{proto}.json"
    data_f.write_text(json.dumps(data))
    return data_f


def perf_command(pa: str, a: argparse.Namespace, url: str, proto: str, streaming: bool, data_f: Path, c: int,
                 prof: Path) -> list[str]:
    return [pa, "-m", "tensorrt_llm", "-u", url, "-i", proto,
            *(["--streaming"] if streaming else []), "--input-data", str(data_f),
            "--concurrency-range", f"{c}:{c}", "--measurement-mode", "count_windows",
            "--measurement-request-count", str(a.requests), "--stability-percentage", str(a.stability),
            "--max-trials", str(a.max_trials), "--profile-export-file", str(prof)]


def run_perf_analyzer(cmd: list[str], env: dict, srv, prof: Path, log: Path, label: str):
    """Run perf_analyzer once, and once more if it exits 0 with an empty profile export (perf_analyzer 2.51 now and
    then does). Returns (the last CompletedProcess, attempts, model counters before, after)."""
    for attempt in (1, 2):
        prof.unlink(missing_ok=True)
        m0 = counters(srv.metrics_url)
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
        m1 = counters(srv.metrics_url)
        log.write_text(f"rc {r.returncode}\n{r.stdout}{r.stderr}")
        if r.returncode != 0 or (prof.exists() and prof.stat().st_size > 0):
            break
        print(f"{label}: perf_analyzer exited 0 with an empty profile export; "
              f"{'running it again' if attempt == 1 else 'giving up'}", file=sys.stderr)
    return r, attempt, m0, m1


@dataclass(frozen=True)
class PerfRun:
    """What every point of one server's run shares: perf_analyzer's path and environment, the command line's
    arguments, the output directory and the input-data file of the protocol."""

    pa: str
    env: dict
    a: argparse.Namespace
    out: Path
    data_f: Path


def measure_point(run: PerfRun, srv, mode: str, k: int, proto: str, c: int,
                  expected: dict[str, tuple[str, int]]) -> tuple[dict, str, int]:
    """One (mode, protocol, concurrency) point on a running server: (its row, the command, failures counted)."""
    pa, env, a, out, data_f = run.pa, run.env, run.a, run.out, run.data_f
    streaming = proto == "grpc"
    prof = out / f"{mode}-{proto}-c{c}.json"
    cmd = perf_command(pa, a, srv.grpc_url if streaming else srv.http_url, proto, streaming, data_f, c, prof)
    r, attempt, m0, m1 = run_perf_analyzer(cmd, env, srv, prof, out / f"{mode}-{proto}-c{c}.log",
                                           f"{mode} {proto} c={c}")
    row = summarize(prof, expected, streaming, m0, m1, rc=r.returncode)
    row["attempts"] = attempt
    row.update(mode=mode, protocol=f"{proto}{' streaming' if streaming else ''}", concurrency=c, draft_len=k)
    if r.returncode != 0:
        print(f"perf_analyzer failed ({mode} {proto} c={c}):\n{(r.stdout + r.stderr)[-2000:]}", file=sys.stderr)
    # a point without a readable profile export (perf_analyzer's own summary is in its .log) fails the
    # run too, but is not a lost response: nothing says a request went unanswered
    bad = row["lost"] + row["mismatches"] + (r.returncode != 0) + row["no_profile"]
    print(f"{mode:11s} {proto:4s} c={c:<3d} {row['throughput_tok_s']} tok/s, TPOT p50 {row['tpot_p50_ms']} ms "
          f"p99 {row['tpot_p99_ms']} ms, rows/forward {row['rows_per_forward']}, lost {row['lost']}, "
          f"mismatches {row['mismatches']}", file=sys.stderr)
    return row, " ".join(shlex.quote(x) for x in cmd), bad


def measure(a: argparse.Namespace, repo: Path, modes: list[str], draft_lens: dict[str, int], conc: list[int],
            prompts: list[str], expected: dict[int, dict[str, tuple[str, int]]],
            out: Path) -> tuple[list[dict], list[str], int]:
    """The measurement loop: per mode and protocol a fresh Triton server, perf_analyzer at each concurrency.
    Returns (rows, perf_analyzer commands, failures counted)."""
    from runtime.serving import triton_server

    env = dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(p for p in (cudart_dir(), os.environ.get("LD_LIBRARY_PATH", "")) if p))
    pa = perf_analyzer()
    rows, cmds, bad = [], [], 0
    for mode in modes:
        k = draft_lens[mode]
        for proto in a.protocols.split(","):
            streaming = proto == "grpc"
            data_f = write_input_data(out, proto, prompts, a.max_tokens, streaming)
            params = {"specpipe_max_batch": str(max(conc)), "specpipe_max_queue": str(max(conc)), "specpipe_draft_len": str(k)}
            srv = triton_server.start(repo, load=triton_server.ModelLoad(parameters=params, decoupled=streaming),
                                       ready_timeout=120)
            try:
                for c in conc:
                    row, cmd, failed = measure_point(PerfRun(pa, env, a, out, data_f), srv, mode, k, proto, c, expected[k])
                    rows.append(row)
                    cmds.append(cmd)
                    bad += failed
            finally:
                srv.stop()
    return rows, cmds, bad


def main() -> int:
    a = parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    conc = [int(c) for c in a.concurrency.split(",")]
    repo, model_dir, spec = exported_model(a.workdir)
    prompts = eval_prompts(a.workdir, a.prompts)
    out = a.out or Path(tempfile.mkdtemp(prefix="serve_load-"))
    out.mkdir(parents=True, exist_ok=True)
    modes = measured_modes(a, spec)
    draft_lens, expected = reference_outputs(model_dir, spec, modes, prompts, a.max_tokens)

    rows, cmds, bad = measure(a, repo, modes, draft_lens, conc, prompts, expected, out)
    (out / "results.json").write_text(json.dumps({"workdir": str(a.workdir), "rows": rows, "commands": cmds}, indent=1))
    print(table(a, rows, spec))
    print(f"\nprofiles and results: {out}")
    return 1 if bad else 0


def summarize(prof: Path, expected: dict[str, tuple[str, int]], streaming: bool, m0: dict, m1: dict, rc: int) -> dict:
    reqs = []
    try:
        for e in json.loads(prof.read_text()).get("experiments", []):
            reqs += e.get("requests", [])
    except (OSError, ValueError):
        pass                                   # no readable profile: reported as no_profile below
    tpot, ttft, lost, mismatches, tokens = [], [], 0, 0, 0
    starts, ends = [], []
    for q in reqs:
        ts = q.get("response_timestamps") or []
        outs = [o.get("text_output") for o in q.get("response_outputs") or []]
        prompt = (q.get("request_inputs") or {}).get("text_input")
        if not ts or not outs or outs[-1] is None:
            lost += 1
            continue
        want, n = expected.get(prompt, (None, 0))
        if outs[-1] != want:
            mismatches += 1
        tokens += n
        starts.append(q["timestamp"])
        ends.append(ts[-1])
        if streaming:
            ttft.append((ts[0] - q["timestamp"]) / 1e6)
            if n > 1:
                tpot.append((ts[-1] - ts[0]) / 1e6 / (n - 1))
        elif n:
            tpot.append((ts[-1] - q["timestamp"]) / 1e6 / n)
    wall = (max(ends) - min(starts)) / 1e9 if starts else 0
    d = {k: m1.get(k, 0) - m0.get(k, 0) for k in m1}
    fwd, rows_, steps = d.get("specpipe_target_forwards_total", 0), d.get("specpipe_decode_rows_total", 0), \
        d.get("specpipe_verification_steps_total", 0)
    r3 = lambda x: None if x is None else round(x, 3)  # noqa: E731
    return {"requests": len(reqs), "output_tokens": tokens, "throughput_tok_s": r3(tokens / wall) if wall else None,
            "tpot_p50_ms": r3(pct(tpot, 50)), "tpot_p99_ms": r3(pct(tpot, 99)),
            "ttft_p50_ms": r3(pct(ttft, 50)) if streaming else None,
            "rows_per_forward": r3(rows_ / fwd) if fwd else None,
            "acceptance_length": r3(1 + d.get("specpipe_accepted_draft_tokens_total", 0) / steps) if steps else None,
            "lost": lost, "no_profile": not reqs, "mismatches": mismatches, "perf_analyzer_rc": rc}


def table(a, rows: list[dict], spec: dict) -> str:
    head = ("| pair | mode (k) | protocol | concurrency | requests | tokens/s | TPOT p50 ms | TPOT p99 ms | TTFT p50 ms | "
            "rows / forward | AL | lost | greedy mismatches |")
    lines = [f"Command: `OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')} python bench/serve_load.py "
             + " ".join(shlex.quote(x) for x in sys.argv[1:]) + "`", "", head, "|" + "---|" * 13]
    fmt = lambda v: "–" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))  # noqa: E731
    for r in rows:
        lines.append(f"| {a.workdir.name} ({spec.get('algorithm')}) | {r['mode']} ({r['draft_len']}) | {r['protocol']} | "
                     f"{r['concurrency']} | {'no profile export' if r['no_profile'] else r['requests']} | "
                     f"{fmt(r['throughput_tok_s'])} | {fmt(r['tpot_p50_ms'])} | "
                     f"{fmt(r['tpot_p99_ms'])} | {fmt(r['ttft_p50_ms'])} | {fmt(r['rows_per_forward'])} | "
                     f"{fmt(r['acceptance_length'])} | {r['lost']} | {r['mismatches']} |")
    lines.append(f"\n{a.max_tokens} new tokens per request, greedy, {a.requests} measured requests per point "
                 f"(perf_analyzer --measurement-mode count_windows, stability {a.stability:g}%), max_batch = max_queue = "
                 f"{max(int(c) for c in a.concurrency.split(','))}.")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
