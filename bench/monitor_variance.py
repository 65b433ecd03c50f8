"""The canary's per-round acceptance variance on a served pair, for `specpipe monitor`'s no-false-alarm check.

Serves a run's exported CPU repository (`artifacts/export/triton_cpu`) through the real Triton server (nvidia-pytriton's
binary, 127.0.0.1) and probes it as `specpipe monitor` does (pipeline/monitor.py `probe`: the validated prompts per
domain, validate's max_new_tokens, `sampling_param_return_perf_metrics`; the counts read by `perf_counts`), for
`--rounds` rounds at `--temperature`, each request with its own `sampling_param_seed` (the canary at temperature 0 is
deterministic: every round gives the same counts). Writes per round and domain (steps, accepted) and a summary:
the mean and standard deviation of the per-round AL, and the measured dispersion, the variance of a round's mean
accepted count per step times its steps, over the per-step variance the monitor's test assumes for a chain of
that mean (the `dispersion` option covers this ratio; default 2).

    OMP_NUM_THREADS=1 python bench/monitor_variance.py --workdir RUN --rounds 20 --temperature 1.0 \
        --out tests/data/monitor_metrics/measured_canary_rounds.json
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def measured_dispersion(rounds: list[dict], domain: str, draft_len: int) -> dict:
    """Per-round AL mean/sd of `domain` and the measured dispersion against a constant-p chain of the same mean."""
    from pipeline.monitor import scaled_for_mean, step_moments

    xs = [r[domain]["accepted"] / r[domain]["steps"] for r in rounds]
    ns = [r[domain]["steps"] for r in rounds]
    mean_x = sum(r[domain]["accepted"] for r in rounds) / sum(ns)
    _, var_step = step_moments(scaled_for_mean([1.0] * draft_len, mean_x))
    var_x = statistics.variance(xs) if len(xs) > 1 else 0.0
    return {"rounds": len(xs), "al_mean": round(1 + statistics.fmean(xs), 4), "al_sd": round(statistics.pstdev(xs), 4)
            if len(xs) > 1 else 0.0, "al_sd_sample": round(var_x ** 0.5, 4), "steps_mean": round(statistics.fmean(ns), 2),
            "chain_var_per_step": round(var_step, 4),
            "dispersion": round(var_x * statistics.fmean(ns) / var_step, 3) if var_step > 0 else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", required=True, type=Path)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--prompts-per-probe", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    from pipeline import monitor as M
    from runtime.serving import triton_server
    from runtime.serving.prompt_format import text_input_for

    run = M.read_run(a.workdir, prompts_per_probe=a.prompts_per_probe)
    tmp = Path(tempfile.mkdtemp(prefix="specpipe-variance-"))
    repo = tmp / "repo"
    shutil.copytree(a.workdir / "artifacts" / "export" / "triton_cpu", repo)
    t0 = time.time()
    srv = triton_server.start(repo, ready_timeout=300)
    rounds, seed = [], 0
    try:
        url = f"http://{srv.http_url}"
        for i in range(a.rounds):
            row = {}
            for d, prompts in run.prompts.items():
                drafted = accepted = 0
                for p in prompts:
                    seed += 1
                    body = {"text_input": text_input_for(p, run.prompt_format), "sampling_param_max_tokens":
                            run.max_new_tokens, "sampling_param_return_perf_metrics": True,
                            "sampling_param_temperature": a.temperature, "sampling_param_seed": seed}
                    out = _generate(url, run.model_name, body)
                    n_d, n_a = M.perf_counts(out, url)
                    drafted += n_d
                    accepted += n_a
                row[d] = {"steps": drafted / run.draft_len, "accepted": accepted}
            rounds.append(row)
            print(f"round {i + 1}/{a.rounds} " + " ".join(f"{d} AL {1 + r['accepted'] / r['steps']:.3f}"
                                                          for d, r in row.items()), flush=True)
    finally:
        srv.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    summary = {d: measured_dispersion(rounds, d, run.draft_len) for d in run.prompts}
    doc = {"workdir": str(a.workdir), "temperature": a.temperature, "draft_len": run.draft_len,
           "max_new_tokens": run.max_new_tokens, "prompts_per_domain": {d: len(p) for d, p in run.prompts.items()},
           "validated_al": {d: round(M.make_test(d, pp, M.Design(draft_len=run.draft_len)).al0, 4)
                            for d, pp in run.baseline.items()},
           "wall_s": round(time.time() - t0, 1), "summary": summary, "rounds": rounds}
    print(json.dumps({k: v for k, v in doc.items() if k != "rounds"}, indent=1))
    if a.out:
        a.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


def _generate(url: str, model: str, body: dict) -> dict:
    import urllib.request

    req = urllib.request.Request(f"{url}/v2/models/{model}/generate", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:  # noqa: S310 - the local server this script started
        return json.loads(r.read())


if __name__ == "__main__":
    raise SystemExit(main())
