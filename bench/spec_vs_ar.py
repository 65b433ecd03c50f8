"""Speculative vs autoregressive decoding of a deployed pair, in one process, on the same prompts.

Prints tokens/s of each, the measured speedup, and the speedup predicted from the measured acceptance length
and the measured step costs (anchors.md: S = AL * T_target(1) / (k * T_draft + T_target(k+1)); DFlash pays one
draft pass instead of k). Also times the target's plain decoding against Hugging Face `generate` on the same
BF16 model, greedy, same number of new tokens.

    OMP_NUM_THREADS=1 python bench/spec_vs_ar.py --workdir runs/tiny_fp8_eagle3
    python bench/spec_vs_ar.py --target DIR --draft DIR [--bf16-target DIR] --prompts-from DIR/eval

With --workdir the deployed pair comes from artifacts/quantize/quantize.json, the BF16 target from
artifacts/target/model and the prompts from artifacts/data/eval/*.jsonl.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _prompts(eval_dir: Path, n: int) -> list[list[int]]:
    out = []
    for f in sorted(eval_dir.glob("*.jsonl")):
        rows = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
        out += [r["prompt_ids"] for r in rows[: max(1, n // max(1, len(list(eval_dir.glob('*.jsonl')))))]]
    return out[:n]


def _timed(fn, repeats: int):
    """Median wall time over repeats (after one warm-up call) and the last result."""
    fn()
    times, res = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), res


def isolated_costs(model, draft, k: int, ctx_len: int, reps: int = 50) -> dict:
    """Step costs timed in isolation (tight loops at a fixed context length, caches rolled back after each
    call), independent of the decoding loop: target forward of 1 and k+1 tokens, and the draft work of one
    step (EAGLE-3: a 2-position pass over newly verified tokens + k-1 chain passes; DFlash: 2 context
    positions + one block pass)."""
    import torch

    from runtime.engine.drafters import make_drafter
    from runtime.engine.target import TargetRunner

    r = TargetRunner(model, draft.capture_layers)
    r.reset(1, ctx_len + k + 16)
    ids = torch.randint(0, r.vocab_size, (1, ctx_len))
    with torch.no_grad():
        _, hid = r.forward(ids)
        r.commit(torch.tensor([ctx_len]))

        def t(fn):
            fn()
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            return (time.perf_counter() - t0) / reps

        t1 = t(lambda: r.forward(ids[:, :1]))
        tv = t(lambda: r.forward(ids[:, : k + 1]))
        dr = make_drafter(draft, r)
        dr.reset(1, ctx_len + k + 16)
        dr.observe(hid, ids, torch.tensor([ctx_len]))
        if not draft.traits.drafts_block:
            dr.propose(ids[:, -1], 1, 0.0, None)             # fills the chain drafter's cache with the context
        base = dr.cache.lengths.clone()

        def one_step():
            dr.cache.lengths = base.clone()
            dr.observe(hid[:, :2], ids[:, :2], torch.tensor([2]))
            dr.propose(ids[:, -1], k, 0.0, None)

        td = t(one_step)
    return {"target_1": t1, "target_verify": tv, "draft_step": td}


def parse_args(argv=None) -> argparse.Namespace:
    """The options; with --workdir the pair, the BF16 target and the prompts default to the run's artifacts."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--target", type=Path)
    ap.add_argument("--draft", type=Path)
    ap.add_argument("--bf16-target", type=Path)
    ap.add_argument("--prompts-from", type=Path)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--draft-len", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args(argv)
    if a.workdir:
        arts = a.workdir / "artifacts"
        from pipeline.artifacts import quantize as quantize_artifact

        q = quantize_artifact.read_info(arts / "quantize")
        a.target, a.draft = q.target_dir(arts), q.draft_dir(arts)
        a.bf16_target = a.bf16_target or arts / "target" / "model"
        a.prompts_from = a.prompts_from or arts / "data" / "eval"
    if not (a.target and a.draft and a.prompts_from):
        ap.error("give --workdir, or --target, --draft and --prompts-from")
    return a


def _merged(gens):
    """The decoding stats of several generate() results, merged."""
    st = gens[0].stats
    for g in gens[1:]:
        st = st.merge(g.stats)
    return st


def decode_both(eng, prompts: list[list[int]], N: int, k: int, repeats: int):
    """The measurement loop: every prompt decoded autoregressively, then speculatively (batch 1, request after
    request: the latency setting speculative decoding targets), each timed over `repeats`.
    Returns (t_ar, ar results, t_sp, speculative results, output tokens of one pass)."""
    def run(spec: bool):
        return [eng.generate([p], max_new_tokens=N, draft_len=k if spec else 0) for p in prompts]

    t_ar, ar = _timed(lambda: run(False), repeats)
    t_sp, sp = _timed(lambda: run(True), repeats)
    toks = sum(len(g.tokens[0]) for g in ar)
    assert toks == sum(len(g.tokens[0]) for g in sp) == N * len(prompts)
    return t_ar, ar, t_sp, sp, toks


def lossless_check(model, prompts: list[list[int]], ar, sp) -> str:
    """Whether speculative decoding gave the autoregressive tokens: `identical`, or how many outputs differ and the
    target's top-2 logit margins where they diverge (a tiny margin marks a numerical tie)."""
    from runtime.engine.lossless import lossless_diff, tie_margins

    bad = tie_margins(model, prompts, [g.tokens[0] for g in ar],
                      lossless_diff([g.tokens[0] for g in sp], [g.tokens[0] for g in ar]))
    return "identical" if not bad else f"{len(bad)} differ, top-2 margins {[round(b['margin'], 6) for b in bad]}"


@dataclass(frozen=True)
class Arm:
    """One side of the comparison as decoded: its wall seconds and its merged RunStats."""

    seconds: float
    stats: object


def speed_results(a: argparse.Namespace, draft, prompts: list[list[int]], ar: Arm, sp: Arm, toks: int,
                  lossless: str) -> tuple[dict, float]:
    """The measured speeds of the autoregressive (`ar`) and speculative (`sp`) arms and the speedup predicted from
    the step costs measured in the decoding loop. Returns (results, the unrounded prediction)."""
    from runtime.engine.stats import predicted_speedup

    t_ar, t_sp, st_ar, st_sp = ar.seconds, sp.seconds, ar.stats, sp.stats
    k, N = a.draft_len, a.max_new_tokens
    parallel = draft.traits.drafts_block
    passes = 1 if parallel else k
    t_target1 = st_ar.target_s / len(st_ar.rows_per_step)
    t_verify = st_sp.target_s / st_sp.steps
    t_draft = st_sp.draft_s / st_sp.steps / passes
    pred = predicted_speedup(st_sp.acceptance_length, k, t_target1, t_draft, t_verify, parallel_draft=parallel)
    res = {
        "prompts": len(prompts), "max_new_tokens": N, "draft_len": k, "algorithm": draft.algorithm,
        "threads": a.threads, "target": str(a.target), "draft": str(a.draft),
        "ar_tokens_per_s": round(toks / t_ar, 1), "spec_tokens_per_s": round(toks / t_sp, 1),
        "speedup_measured": round(t_ar / t_sp, 3), "acceptance_length": round(st_sp.acceptance_length, 3),
        "per_position": [round(p, 3) if p is not None else None for p in st_sp.per_position],
        "step_ms": {"target_1": round(1e3 * t_target1, 3), "target_verify": round(1e3 * t_verify, 3),
                    "draft_pass": round(1e3 * t_draft, 3),
                    "spec_overhead_per_step": round(1e3 * st_sp.other_s / st_sp.steps, 3),
                    "ar_overhead_per_step": round(1e3 * st_ar.other_s / len(st_ar.rows_per_step), 3)},
        "speedup_predicted": round(pred, 3), "lossless": lossless,
    }
    res["fraction_of_predicted"] = round(res["speedup_measured"] / pred, 3)
    return res, pred


def add_isolated_prediction(res: dict, model, draft, k: int, ctx_len: int, acceptance_length: float) -> float:
    """Adds the step costs timed in isolation at `ctx_len` and the speedup they predict to `res`; returns that
    prediction unrounded."""
    iso = isolated_costs(model, draft, k, ctx_len)
    pred_iso = acceptance_length * iso["target_1"] / (iso["draft_step"] + iso["target_verify"])
    res["isolated_step_ms"] = {key: round(1e3 * v, 3) for key, v in iso.items()} | {"context": ctx_len}
    res["speedup_predicted_isolated"] = round(pred_iso, 3)
    res["fraction_of_predicted_isolated"] = round(res["speedup_measured"] / pred_iso, 3)
    return pred_iso


def hf_comparison(bf16_target: Path, prompts: list[list[int]], N: int, repeats: int, toks: int) -> dict:
    """The BF16 target's plain decoding in this runtime against Hugging Face `generate`, greedy, same tokens."""
    import torch

    from runtime.engine.speculative import SpeculativeEngine
    from runtime.engine.target import load_target

    bf = load_target(bf16_target)
    e2 = SpeculativeEngine(bf, drafter=None)
    t_ours, ours = _timed(lambda: [e2.generate([p], max_new_tokens=N).tokens[0] for p in prompts], repeats)

    def hf():
        out = []
        for p in prompts:
            x = torch.tensor([p])
            y = bf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=N, min_new_tokens=N,
                            do_sample=False, pad_token_id=bf.config.eos_token_id)
            out.append(y[0, len(p):].tolist())
        return out

    with torch.no_grad():
        t_hf, hf_out = _timed(hf, repeats)
    return {"bf16_target": str(bf16_target), "ar_bf16_tokens_per_s": round(toks / t_ours, 1),
            "hf_generate_tokens_per_s": round(toks / t_hf, 1), "ar_vs_hf_generate": round(t_hf / t_ours, 3),
            "ar_equals_hf_generate": ours == hf_out}


def print_summary(a: argparse.Namespace, res: dict, pred: float, pred_iso: float) -> None:
    k, ctx_len = a.draft_len, res["isolated_step_ms"]["context"]
    print(f"pair: {a.target} + {a.draft} ({res['algorithm']}), {res['prompts']} prompts x {a.max_new_tokens} new tokens, "
          f"batch 1, {a.threads} thread(s)")
    print(f"autoregressive      {res['ar_tokens_per_s']:8.1f} tok/s")
    print(f"speculative (k={k})  {res['spec_tokens_per_s']:8.1f} tok/s   AL {res['acceptance_length']:.2f}, "
          f"lossless {res['lossless']}")
    print(f"speedup measured {res['speedup_measured']:.3f}, predicted {pred:.3f} "
          f"(step ms: target {res['step_ms']['target_1']}, verify {res['step_ms']['target_verify']}, "
          f"draft pass {res['step_ms']['draft_pass']}) -> {100 * res['fraction_of_predicted']:.0f}% of predicted")
    print(f"with step costs timed in isolation (context {ctx_len}): target {res['isolated_step_ms']['target_1']} ms, "
          f"verify {res['isolated_step_ms']['target_verify']} ms, draft step {res['isolated_step_ms']['draft_step']} ms "
          f"-> predicted {pred_iso:.3f}, measured is {100 * res['fraction_of_predicted_isolated']:.0f}% of it")
    if "hf_generate_tokens_per_s" in res:
        print(f"BF16 target: this runtime {res['ar_bf16_tokens_per_s']:.1f} tok/s vs HF generate "
              f"{res['hf_generate_tokens_per_s']:.1f} tok/s (x{res['ar_vs_hf_generate']:.2f}; same tokens: "
              f"{res['ar_equals_hf_generate']})")


def main(argv=None) -> dict:
    a = parse_args(argv)

    import torch

    from runtime.engine.speculative import SpeculativeEngine, load_pair

    torch.set_num_threads(a.threads)
    prompts = _prompts(a.prompts_from, a.prompts)
    model, draft = load_pair(a.target, a.draft)
    eng = SpeculativeEngine(model, draft)
    k, N = a.draft_len, a.max_new_tokens

    t_ar, ar, t_sp, sp, toks = decode_both(eng, prompts, N, k, a.repeats)
    lossless = lossless_check(model, prompts, ar, sp)
    st_ar, st_sp = _merged(ar), _merged(sp)
    res, pred = speed_results(a, draft, prompts, Arm(t_ar, st_ar), Arm(t_sp, st_sp), toks, lossless)
    ctx_len = int(sum(len(p) for p in prompts) / len(prompts) + N / 2)
    pred_iso = add_isolated_prediction(res, model, draft, k, ctx_len, st_sp.acceptance_length)
    if a.bf16_target:
        res.update(hf_comparison(a.bf16_target, prompts, N, a.repeats, toks))

    print_summary(a, res, pred, pred_iso)
    if a.json:
        a.json.write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
