"""The trained draft with TensorRT-LLM's suffix-automaton enhancer (runtime/engine/suffix.py) against the trained draft
alone, n-gram prompt lookup and plain decoding of the deployed pair: batch 1, request after request, greedy, per
domain, in one process. The arms are timed interleaved (plain, trained, n-gram, hybrid, then again) so that load
from other processes falls on all of them alike; the medians are compared. Every speculative arm's output is
checked against the plain output token for token.

    OMP_NUM_THREADS=1 python bench/hybrid_bench.py --workdir runs/tiny_fp8_eagle3 --draft-len 4 --threshold 4

--extra NAME=FILE.jsonl adds a domain from rows {"prompt": text} (rendered with the target's chat template, one user
turn), e.g. prompts whose answers copy text from the prompt.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per domain")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--draft-len", type=int, default=4)
    ap.add_argument("--threshold", type=int, default=4, help="SAEnhancerConfig.threshold")
    ap.add_argument("--ngram", default="1,4", help="n-gram min_n,max_n")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--extra", action="append", default=[], help="NAME=FILE.jsonl with {'prompt': text} rows")
    ap.add_argument("--domains", help="comma-separated: only these domains")
    ap.add_argument("--json", type=Path)
    return ap.parse_args(argv)


def domains(a, tok_dir: Path) -> dict[str, list[list[int]]]:
    """Per domain the first `--prompts` prompts: the run's eval sets, then the --extra ones rendered as chats."""
    out = {}
    for f in sorted((a.workdir / "artifacts" / "data" / "eval").glob("*.jsonl")):
        rows = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
        out[f.stem] = [r["prompt_ids"] for r in rows[:a.prompts]]
    if a.extra:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tok_dir)
        for spec in a.extra:
            name, path = spec.split("=", 1)
            rows = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()][:a.prompts]
            texts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                             tokenize=False) for r in rows]
            out[name] = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    return {d: ps for d, ps in out.items() if not a.domains or d in a.domains.split(",")}


ARMS = ("plain", "trained", "ngram", "hybrid")


def one_domain(arm, ps, repeats: int) -> dict:
    """Every arm on the domain's prompts, interleaved `repeats` times; medians compared."""
    times = {n: [] for n in ARMS}
    outs, stats, extra = {}, {}, {}
    for _ in range(repeats):
        for n in ARMS:
            dt, st, o, ex = arm(n, ps)
            times[n].append(dt)
            outs[n], stats[n], extra[n] = o, st, ex
    toks = sum(len(o) for o in outs["plain"])
    med = {n: statistics.median(times[n]) for n in ARMS}
    return {"prompts": len(ps), "tokens": toks, "seconds": {n: round(med[n], 3) for n in ARMS},
            "tokens_per_s": {n: round(toks / med[n], 2) for n in ARMS},
            "speedup_vs_plain": {n: round(med["plain"] / med[n], 3) for n in ARMS},
            "hybrid_vs_trained": round(med["trained"] / med["hybrid"], 3),
            "acceptance_length": {n: round(stats[n].acceptance_length, 3) for n in ARMS if n != "plain"},
            "identical_to_plain": {n: outs[n] == outs["plain"] for n in ARMS if n != "plain"},
            "hybrid_counters": extra["hybrid"]}


def main(argv=None) -> dict:
    a = parse_args(argv)
    import torch

    from pipeline.artifacts import quantize as quantize_artifact
    from runtime.engine.ngram_drafter import NgramDrafter
    from runtime.engine.speculative import SpeculativeEngine, load_pair
    from runtime.engine.suffix import SuffixEnhancedDrafter

    torch.set_num_threads(a.threads)
    arts = a.workdir / "artifacts"
    q = quantize_artifact.read_info(arts / "quantize")
    model, draft = load_pair(q.target_dir(arts), q.draft_dir(arts))
    prompts = domains(a, q.target_dir(arts))
    lo, hi = (int(x) for x in a.ngram.split(","))
    eng = SpeculativeEngine(model, draft)
    trained = eng.drafter
    ng_eng = SpeculativeEngine(model, drafter=NgramDrafter(lo, hi, model.config.vocab_size))
    k, N = a.draft_len, a.max_new_tokens

    def arm(name: str, ps):
        e, kk = (ng_eng, k) if name == "ngram" else (eng, 0 if name == "plain" else k)
        if name in ("trained", "plain"):
            eng.drafter = trained
        elif name == "hybrid":
            eng.drafter = SuffixEnhancedDrafter(trained, threshold=a.threshold)
        t0 = time.perf_counter()
        gens = [e.generate([p], max_new_tokens=N, draft_len=kk) for p in ps]
        dt = time.perf_counter() - t0
        st = gens[0].stats
        for g in gens[1:]:
            st = st.merge(g.stats)
        extra = eng.drafter.counters() if name == "hybrid" else {}
        return dt, st, [g.tokens[0] for g in gens], extra

    res: dict = {"settings": {k2: str(v) for k2, v in vars(a).items()}, "domains": {}}
    with torch.no_grad():
        for d, ps in prompts.items():
            res["domains"][d] = r = one_domain(arm, ps, a.repeats)
            print(f"{d:>12}: AL trained {r['acceptance_length']['trained']:.3f} ngram {r['acceptance_length']['ngram']:.3f} "
                  f"hybrid {r['acceptance_length']['hybrid']:.3f} | speedup vs plain: trained "
                  f"{r['speedup_vs_plain']['trained']:.3f} ngram {r['speedup_vs_plain']['ngram']:.3f} hybrid "
                  f"{r['speedup_vs_plain']['hybrid']:.3f} (hybrid/trained {r['hybrid_vs_trained']:.3f}); "
                  f"identical {r['identical_to_plain']}", flush=True)
    if a.json:
        a.json.write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
