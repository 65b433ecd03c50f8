"""vLLM's acceptance length beside specpipe's runtime on a finished run's BF16 pair, with the agreement gate's noise.

What validate's vLLM arm measures (runtime/validate/vllm_arm.py), without re-running validate (whose fingerprint
would first retrain an out-of-date draft), at any number of prompts per domain: the runtime decodes each domain's
evaluation prompts (greedy, stop at the target's end-of-sequence ids, validate's batch), vLLM serves the same BF16
target with the speculators conversion of the same draft and decodes them one request at a time with its counters
read around each; per domain the two ALs, their relative difference and its noise under a paired bootstrap over
prompts (runtime/validate/agreement.py), and the gate's verdict at `--tolerance`.

    SPECPIPE_VLLM_PYTHON=... python bench/vllm_agreement.py --workdir runs/smollm2_fp8_eagle3 --prompts-per-domain 16
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--prompts-per-domain", type=int, default=16)
    ap.add_argument("--eval-dir", type=Path, default=None,
                    help="a data artifact to take the evaluation prompts from (default: the workdir's); e.g. one the "
                         "data stage wrote with a larger data.eval_prompts, to measure on more prompts than validate has")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--draft-len", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4, help="the runtime's batch (validate.batch_size)")
    ap.add_argument("--tolerance", type=float, default=0.05)
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--json", type=Path)
    return ap.parse_args(argv)


def runtime_side(arts: Path, prompts: dict, a, eos: list[int]) -> dict:
    from runtime.engine.speculative import SpeculativeEngine, load_pair
    from runtime.validate.agreement import pooled_al

    eng = SpeculativeEngine(*load_pair(arts / "target" / "model", arts / "train_draft" / "draft"))
    out = {}
    for d, ps in prompts.items():
        rows, t0 = [], time.perf_counter()
        for i in range(0, len(ps), a.batch):
            g = eng.generate([p.prompt_ids for p in ps[i:i + a.batch]], max_new_tokens=a.max_new_tokens,
                             draft_len=a.draft_len, eos_token_id=eos)
            rows += [[r.steps, r.accepted] for r in g.requests]
        out[d] = {"acceptance_length": round(pooled_al(rows), 6), "steps": sum(r[0] for r in rows), "per_prompt": rows,
                  "seconds": round(time.perf_counter() - t0, 1)}
        print(f"runtime {d}: AL {out[d]['acceptance_length']:.3f} ({out[d]['seconds']} s)", flush=True)
    return out


def vllm_side(arts: Path, prompts: dict, a, work: Path) -> dict:
    from runtime.validate import vllm_arm as V
    from runtime.vllm import engine as E
    from runtime.vllm.speculators_format import write_speculators_draft

    install = E.find_vllm(a.vllm_python)
    spec = write_speculators_draft(arts / "train_draft" / "draft", work / "speculators", target_dir=arts / "target" / "model",
                                   speculative_tokens=a.draft_len)
    longest = max(len(p.prompt_ids) for ps in prompts.values() for p in ps)
    srv = E.VllmServer(install, E.ServeArgs(str(arts / "target" / "model"), draft=str(spec.path), method=spec.algorithm,
                                            num_speculative_tokens=a.draft_len,
                                            max_model_len=int((longest + a.max_new_tokens + a.draft_len + 8 + 15) // 16 * 16)),
                       log_path=work / "vllm.log")
    out = {}
    with srv:
        for d, ps in prompts.items():
            _, total, rows = V._per_prompt(srv, [p.prompt_ids for p in ps], a.max_new_tokens)
            out[d] = {**total.to_json(), "per_prompt": rows}
            print(f"vLLM {d}: AL {out[d]['acceptance_length']}", flush=True)
    return {"version": install.version, "device": install.device, "domains": out}


def main(argv=None) -> int:
    from pipeline.artifacts import target as target_artifact
    from pipeline.artifacts.data import read_eval
    from pipeline.commands import stop_signals
    from runtime.validate import vllm_arm as V

    stop_signals()   # `kill` stops the vLLM/Triton servers this run started, as Ctrl-C does
    a = parse_args(argv)
    arts = a.workdir / "artifacts"
    eos = list(target_artifact.read_info(arts / "target").stop_ids)
    prompts = read_eval(a.eval_dir or arts / "data", per_domain=a.prompts_per_domain)
    short = {d: len(ps) for d, ps in prompts.items() if len(ps) < a.prompts_per_domain}
    if short:
        print(f"error: --prompts-per-domain {a.prompts_per_domain}, but {a.eval_dir or arts / 'data'} holds only "
              f"{short}: pass --eval-dir with a data artifact written with data.eval_prompts >= "
              f"{a.prompts_per_domain}", file=sys.stderr)
        return 2
    rt = runtime_side(arts, prompts, a, eos)
    with tempfile.TemporaryDirectory(prefix="vllm-agreement-") as tmp:
        vl = vllm_side(arts, prompts, a, Path(tmp))
    v = {"domains": vl["domains"], "lossless": {"speculative_diverging": 0, "prompts": 0, "noise_diverging": 0,
                                                "passed": True}}
    rows = V.agreement(v, {d: (r["acceptance_length"], r["steps"], r["per_prompt"]) for d, r in rt.items()},
                       a.tolerance)[:-1]
    print(f"\nvLLM {vl['version']} ({vl['device']}) vs specpipe runtime, BF16 pair, k = {a.draft_len}, "
          f"{a.prompts_per_domain} prompts x {a.max_new_tokens} tokens per domain")
    print(f"{'domain':<12} {'AL vLLM':>8} {'AL runtime':>10} {'difference':>10} {'noise (99%)':>11}  gate")
    for r in rows:                       # agreement() leaves out a domain without an AL on either side
        d, c = r["domain"], v["domains"][r["domain"]]
        print(f"{d:<12} {c['acceptance_length']:>8.3f} {c['validate_acceptance_length']:>10.3f} "
              f"{c['relative_difference']:>10.1%} {c['noise'] or 0:>11.1%}  {'pass' if r['passed'] else 'FAIL'}")
    if a.json:
        a.json.write_text(json.dumps({"args": {k: str(x) for k, x in vars(a).items()}, "runtime": rt, "vllm": vl,
                                      "gate_rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
