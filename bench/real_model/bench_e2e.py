"""End to end on a deployed pair: plain and speculative decoding in specpipe's runtime, Hugging Face `generate`
of the same BF16 model, and the speedup limit from the measured step times, per domain, at batch 1 and 4.

    OMP_NUM_THREADS=2 python bench/real_model/bench_e2e.py --workdir runs/smollm2_fp8_eagle3 \\
        [--batch 1,4] [--prompts 4] [--max-new-tokens 64] [--draft-len K] [--compute fp32,bf16] [--rounds 2] \\
        [--threads 2] [--json out.json]

The workdir is one `specpipe build` wrote (at least through quantize): the deployed pair is what
artifacts/quantize/quantize.json names (FP8 target + draft), the BF16 model is artifacts/target/model, the
prompts are the first --prompts of each artifacts/data/eval/<domain>.jsonl (the ones validate measures). The
draft length is --draft-len, else the deployed one (tune's deployment, batch 1), else validate.max_draft_len (4).

Every arm decodes the same prompts for exactly --max-new-tokens tokens (no stop at end-of-turn, so each arm does
the same work), greedy; batch B = the domain's prompts in groups of B. Arms, timed in turn within each round
(`--rounds` rounds: a load change on the machine hits every arm alike; medians over rounds):
  ar/<mode>    plain decoding of the deployed FP8 target in the runtime (`SpeculativeEngine`, draft_len 0)
  spec/<mode>  speculative decoding of the deployed pair in the runtime, k = draft length
  hf/bf16      `model.generate` of the BF16 checkpoint loaded in bfloat16 (its dtype), greedy, KV cache
  hf/fp32      the same in float32
for each runtime compute mode <mode> (`fp32` exact, default; `bf16` where the runtime's `auto` takes it, as the stages
do: native bf16 GEMMs AND measured faster than fp32 on this machine, `runtime.engine.precision.cpu_precision`).

Limit (anchors.md): S = AL x T(1) / (T(k+1) + k x T_draft), AL from the speculative arm of the same domain and
batch, T(m) a target forward of m tokens per row at batch B and the domains' mean context, k x T_draft the
draft's work per step (EAGLE-3: context update + k chain passes; DFlash: one block pass), measured by
bench_steps.py's step timers in the same process. Prints Markdown with the machine load (`uptime`) before and
after; absolute tokens/s on a shared machine are noisy, the ratios of arms measured side by side much less.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))


def read_prompts(data_art: Path, n: int, domains: list[str] | None) -> dict[str, list[list[int]]]:
    """The first `n` eval prompts of each domain, through the data artifact's reader (the ones validate measures)."""
    from pipeline.artifacts.data import read_eval

    out = {d: [p.prompt_ids for p in ps] for d, ps in read_eval(data_art, domains=domains, per_domain=n).items()}
    if not out:
        raise SystemExit(f"{data_art}: no evaluation prompts for domains {domains}")
    return out


def deployed_draft_len(arts: Path) -> int | None:
    """The draft length the deployment runs at batch 1 (build's DraftSchedule), None without a build artifact."""
    from pipeline.artifacts import build

    if not (arts / "build" / build.INFO).exists():
        return None
    return build.read_deployment(arts / "build").schedule().k_at(1) or None


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "load average: {:.2f}, {:.2f}, {:.2f}".format(*os.getloadavg())


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per domain")
    ap.add_argument("--domains", help="comma-separated subset of the eval domains")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--draft-len", type=int)
    ap.add_argument("--compute", help="runtime compute modes (default: fp32, and bf16 where compute auto takes it)")
    ap.add_argument("--no-hf-fp32", action="store_true", help="skip the float32 HF generate arm")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    return ap.parse_args(argv)


def setup(a) -> dict:
    """What the arms run: the deployed pair (quantize.json's FP8 target + draft), the BF16 checkpoint for HF, the
    prompts, the draft length, the compute modes; and the run's metadata."""
    import torch

    from pipeline.artifacts import quantize, train_draft
    from pipeline.errors import StageError
    from runtime.engine.compute import default_modes, native_bf16_gemm, resolve_compute
    from runtime.engine.precision import cpu_precision

    arts = a.workdir / "artifacts"
    try:
        q = quantize.read_info(arts / "quantize")
    except StageError as e:
        raise SystemExit(f"{a.workdir}: no committed quantize artifact ({e}); "
                         "run `specpipe build <config>` through quantize") from None
    env = {"target_dir": q.target_dir(arts), "draft_dir": q.draft_dir(arts), "bf16_dir": arts / "target" / "model",
           "k": a.draft_len or deployed_draft_len(arts) or 4,
           "modes": a.compute.split(",") if a.compute else default_modes(),
           "batches": [int(b) for b in a.batch.split(",")],
           "prompts": read_prompts(arts / "data", a.prompts, a.domains.split(",") if a.domains else None)}
    meta = {"workdir": str(a.workdir), "target_dir": str(env["target_dir"]), "draft_dir": str(env["draft_dir"]),
            "draft_len": env["k"], "modes": env["modes"], "batches": env["batches"], "max_new_tokens": a.max_new_tokens,
            "threads": a.threads, "rounds": a.rounds, "uptime_before": uptime(),
            "prompts_per_domain": {d: len(p) for d, p in env["prompts"].items()},
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "torch": torch.__version__,
            "native_bf16_gemm": native_bf16_gemm(), "compute_auto": resolve_compute("auto"),
            "precision": cpu_precision().record()}
    if (arts / "train_draft" / train_draft.INFO).exists():
        d = train_draft.read_info(arts / "train_draft")
        meta["train_draft"] = {"algorithm": d.algorithm, "acceptance_length": d.raw.get("acceptance_length")}
    return {"env": env, "meta": meta}


def load_models(env: dict, hf_fp32: bool) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from runtime.engine.speculative import SpeculativeEngine, load_pair

    model, draft = load_pair(env["target_dir"], env["draft_dir"])
    hf = {"bf16": AutoModelForCausalLM.from_pretrained(env["bf16_dir"], dtype=torch.bfloat16).eval()}
    if hf_fp32:
        hf["fp32"] = AutoModelForCausalLM.from_pretrained(env["bf16_dir"], dtype=torch.float32).eval()
    pad = hf["bf16"].config.pad_token_id
    return {"model": model, "draft": draft, "hf": hf, "pad": int(pad if pad is not None else 0),
            "engines": {m: SpeculativeEngine(model, draft, compute=m) for m in env["modes"]}}


def groups(ps, b):
    return [ps[i:i + b] for i in range(0, len(ps), b)]


def runtime_arm(eng, ps, b, k, n_new, stats):
    """Plain (k = 0) or speculative decoding of the prompts in groups of b, exactly n_new tokens each."""
    def run():
        toks = 0
        for g in groups(ps, b):
            out = eng.generate(g, max_new_tokens=n_new, draft_len=k, eos_token_id=None)
            toks += sum(map(len, out.tokens))
            if k:
                stats.append(out.stats)
        return toks
    return run


def hf_arm(m, ps, b, n_new, pad):
    """HF `generate`, greedy with KV cache, left-padded groups of b, exactly n_new tokens each."""
    import torch

    def run():
        toks = 0
        for g in groups(ps, b):
            L = max(map(len, g))
            ids = torch.tensor([[pad] * (L - len(p)) + p for p in g])
            att = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in g])
            out = m.generate(ids, attention_mask=att, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                             eos_token_id=None, pad_token_id=pad)
            toks += (out.shape[1] - L) * len(g)
        return toks
    return run


def measure_domain(dom, ps, b, env, models, a) -> dict:
    """Every arm on one domain at batch b, timed in turn within each round; tokens/s from the median round."""
    arms, stats = {}, {m: [] for m in env["modes"]}
    for m in env["modes"]:
        arms[f"ar/{m}"] = runtime_arm(models["engines"][m], ps, b, 0, a.max_new_tokens, [])
        arms[f"spec/{m}"] = runtime_arm(models["engines"][m], ps, b, env["k"], a.max_new_tokens, stats[m])
    for name, hm in models["hf"].items():
        arms[f"hf/{name}"] = hf_arm(hm, ps, b, a.max_new_tokens, models["pad"])
    times, ntok = {n: [] for n in arms}, {}
    for _ in range(a.rounds):
        for n, f in arms.items():
            t0 = time.perf_counter()
            ntok[n] = f()
            times[n].append(time.perf_counter() - t0)
    al = {}
    for m in env["modes"]:
        steps = sum(s.steps for s in stats[m])
        al[m] = 1 + sum(s.accepted for s in stats[m]) / steps if steps else None
    return {"domain": dom, "batch": b, "tokens_per_s": {n: ntok[n] / statistics.median(t) for n, t in times.items()},
            "al": al, "spread": {n: [min(t), max(t)] for n, t in times.items()},
            "context": int(statistics.mean(len(p) for p in ps) + a.max_new_tokens / 2)}


def step_times(env, models, ctx_len) -> tuple[dict, dict]:
    """T(1) and T(k+1) of the target per mode and batch at ctx_len (bench_steps' interleaved timers), and the
    draft's work per step."""
    import torch
    from bench_steps import Repeats, draft_table, fill_cache, interleaved

    k, steps, tdraft = env["k"], {}, {}
    for b in env["batches"]:
        toks = {m: torch.randint(0, 1000, (b, m)) for m in (1, k + 1)}
        fns = {}
        for mode, eng in models["engines"].items():
            r = eng.target
            for mm in (1, k + 1):
                def f(r=r, mm=mm, b=b, toks=toks):
                    if r.cache is None or r.cache.k[0].shape[0] != b or int(r.cache.lengths[0]) != ctx_len:
                        fill_cache(r, b, ctx_len, k + 2)
                    r.forward(toks[mm])
                fns[f"{mode}:T({mm})"] = f
        steps[b] = {n: statistics.median(v) for n, v in interleaved(fns, 5, 3).items()}
        draft = models["draft"]
        drows = draft_table(models["model"], {draft.algorithm: env["draft_dir"]}, env["modes"], ctx_len, k, Repeats(5, 5),
                            batch=b)
        tdraft |= {(r["mode"], b): r["ms"] / 1e3 for r in drows if r["what"] == "step"}
    return steps, tdraft


def add_limits(rows, modes, k, steps, tdraft) -> None:
    """The limit AL x T(1) / (T(k+1) + k x T_draft) per row and mode, and the measured speedup's ratio to it."""
    for r in rows:
        r["limit"], r["ratio_to_limit"] = {}, {}
        for m in modes:
            st = steps[r["batch"]]
            lim = r["al"][m] * st[f"{m}:T(1)"] / (st[f"{m}:T({k + 1})"] + tdraft[(m, r["batch"])]) if r["al"][m] else None
            r["limit"][m] = lim
            meas = r["tokens_per_s"][f"spec/{m}"] / r["tokens_per_s"][f"ar/{m}"]
            r["ratio_to_limit"][m] = meas / lim if lim else None


def main(argv=None) -> dict:
    a = parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    s = setup(a)
    env, meta = s["env"], s["meta"]
    print(json.dumps(meta), flush=True)
    models = load_models(env, not a.no_hf_fp32)
    rows = []
    with torch.no_grad():
        for dom, ps in env["prompts"].items():
            for b in env["batches"]:
                rows.append(measure_domain(dom, ps, b, env, models, a))
                print(json.dumps(rows[-1]), flush=True)
        ctx_len = int(statistics.mean(r["context"] for r in rows))   # the mean context of the measured prompts
        steps, tdraft = step_times(env, models, ctx_len)
    add_limits(rows, env["modes"], env["k"], steps, tdraft)
    meta["uptime_after"] = uptime()
    meta["step_ms"] = {b: {n: 1e3 * v for n, v in st.items()} for b, st in steps.items()}
    meta["draft_step_ms"] = {f"{m} B={b}": 1e3 * v for (m, b), v in tdraft.items()}
    meta["context_for_steps"] = ctx_len
    md = markdown(rows, meta, env["modes"], list(models["hf"]))
    print("\n" + md)
    res = {"meta": meta, "rows": rows, "markdown": md}
    if a.json:
        a.json.write_text(json.dumps(res, indent=2, default=str))
    return res


def markdown(rows, meta, modes, hf_names) -> str:
    out = [f"k = {meta['draft_len']}, {meta['max_new_tokens']} new tokens per prompt, prompts per domain "
           f"{meta['prompts_per_domain']}, {meta['threads']} threads, {meta['rounds']} interleaved rounds (medians); "
           f"started {meta['started']}", f"load before: `{meta['uptime_before']}`",
           f"load after: `{meta['uptime_after']}`", ""]
    head = ["domain", "B"]
    for m in modes:
        head += [f"ar/{m} tok/s", f"spec/{m} tok/s", f"AL ({m})", f"spec/ar ({m})", f"limit ({m})",
                 f"measured/limit ({m})"]
    head += [f"hf/{n} tok/s" for n in hf_names] + [f"spec/{modes[-1]} / hf/{n}" for n in hf_names]
    out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        t = r["tokens_per_s"]
        cells = [r["domain"], str(r["batch"])]
        for m in modes:
            al, lim = r["al"][m], r["limit"][m]
            cells += [f"{t[f'ar/{m}']:.1f}", f"{t[f'spec/{m}']:.1f}", f"{al:.2f}" if al else "-",
                      f"{t[f'spec/{m}'] / t[f'ar/{m}']:.2f}x", f"{lim:.2f}x" if lim else "-",
                      f"{r['ratio_to_limit'][m]:.2f}" if r["ratio_to_limit"][m] else "-"]
        cells += [f"{t[f'hf/{n}']:.1f}" for n in hf_names]
        cells += [f"{t[f'spec/{modes[-1]}'] / t[f'hf/{n}']:.2f}x" for n in hf_names]
        out.append("| " + " | ".join(cells) + " |")
    out += ["", f"Step times at context {meta['context_for_steps']} (ms, medians): " + "; ".join(
        f"B={b}: " + ", ".join(f"{n} {v:.1f}" for n, v in s.items()) for b, s in meta["step_ms"].items()) +
        "; draft work per step (k x T_draft): " +
        ", ".join(f"{m} {v:.1f}" for m, v in meta["draft_step_ms"].items())]
    return "\n".join(out)


if __name__ == "__main__":
    main()
