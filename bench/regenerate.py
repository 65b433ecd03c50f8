"""Regeneration throughput side by side in one run: the same prompts (ShareGPT first user turns, the chat template
applied once), the same max_new_tokens, the same batch, greedy, stopping at <|im_end|> as `data.regenerate` does:

- vLLM: `runtime.data.regen_engines.run_regeneration` with engine vllm (the stage's path: a server started for the
  job in the target's dtype, `batch` requests in flight, token-id prompts and answers);
- specpipe's runtime: `runtime.data.regenerate.regenerate` (batched KV-cache decoding, fp32 compute);
- Hugging Face `generate` (left-padded batches, fp32, the same stop id).

New tokens/s of each (generated tokens up to and including the stop id, over the generation seconds; the load or
server start is reported apart) and the ratio to the runtime.

    nice -n 19 python bench/regenerate.py --prompts 32 --batch 32 --max-new-tokens 128 --json regen.json
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
REAL = Path(__file__).resolve().parent / "real_model" / "prepared"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=REAL / "model" / "SmolLM2-135M-Instruct")
    ap.add_argument("--prompts-file", type=Path, default=REAL / "data" / "sharegpt_chats.jsonl")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=256, help="longer first turns are skipped")
    ap.add_argument("--engines", default="vllm,runtime,hf")
    ap.add_argument("--vllm-dtype", default="bfloat16", help="the stage uses the target's dtype (SmolLM2: bfloat16)")
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    return ap.parse_args(argv)


def load_prompts(a, tok) -> list[list[int]]:
    prompts = []
    with open(a.prompts_file) as f:
        for line in f:
            first = (json.loads(line).get("messages") or [{}])[0]
            if first.get("role") != "user":
                continue
            ids = list(tok.apply_chat_template([first], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
            if len(ids) <= a.max_prompt_tokens:
                prompts.append(ids)
            if len(prompts) == a.prompts:
                break
    return prompts


def stop_id(tok) -> int:
    return tok.convert_tokens_to_ids("<|im_end|>")


def run_vllm(a, tok, prompts, work: Path, log) -> dict:
    from runtime.data import regen_engines as R
    from runtime.data.regenerate import Decoding, RegenRun
    from runtime.vllm.engine import find_vllm

    inst = find_vllm(a.vllm_python)
    eos = stop_id(tok)
    gens, st = R.run_regeneration(
        R.EngineChoice("vllm", "bench", install=inst), vllm_cfg=SimpleNamespace(kv_cache_gib=2, ready_timeout_s=900),
        target=R.RegenTarget(a.model, a.vllm_dtype, max(map(len, prompts)) + a.max_new_tokens + 8, tok, eos),
        prompts=prompts, keys=[f"p{i}" for i in range(len(prompts))], batch_size=a.batch,
        decoding=Decoding(a.max_new_tokens, 0.0, 1.0, [eos], 0), run=RegenRun(work / "regenerate", log))
    return _row(f"vLLM {inst.version} ({inst.device}, {a.vllm_dtype})", gens, st["seconds"], st["load_seconds"])


def run_runtime(a, tok, prompts, log) -> dict:
    from runtime.data.regenerate import Decoding, RegenRun, regenerate

    eos = stop_id(tok)
    gens, st = regenerate(a.model, prompts, [f"p{i}" for i in range(len(prompts))], batch_size=a.batch,
                          decoding=Decoding(a.max_new_tokens, 0.0, 1.0, [eos], 0), run=RegenRun(None, log))
    return _row("specpipe runtime (fp32)", gens, st["seconds"], st["load_seconds"])


def run_hf(a, tok, prompts) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    eos = stop_id(tok)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    load = time.perf_counter() - t0
    gens, secs = [], 0.0
    for i in range(0, len(prompts), a.batch):
        chunk = prompts[i: i + a.batch]
        w = max(map(len, chunk))
        ids = torch.tensor([[eos] * (w - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (w - len(p)) + [1] * len(p) for p in chunk])
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=a.max_new_tokens, do_sample=False,
                                 eos_token_id=[eos], pad_token_id=eos)[:, w:].tolist()
        secs += time.perf_counter() - t0
        gens += [o[: o.index(eos) + 1] if eos in o else o for o in out]
    return _row("HF generate (fp32)", gens, secs, load)


def _row(name: str, gens: list[list[int]], seconds: float, load: float) -> dict:
    n = sum(map(len, gens))
    return {"engine": name, "new_tokens": n, "seconds": round(seconds, 2), "load_seconds": round(load, 2),
            "new_tokens_per_s": round(n / seconds, 2) if seconds else None,
            "mean_new_tokens": round(n / len(gens), 1), "answers": gens}


def main(argv=None) -> dict:
    import tempfile

    import torch
    from transformers import AutoTokenizer

    from pipeline.commands import stop_signals

    stop_signals()   # `kill` stops the vLLM/Triton servers this run started, as Ctrl-C does
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    log = logging.getLogger("bench.regenerate")
    tok = AutoTokenizer.from_pretrained(a.model)
    prompts = load_prompts(a, tok)
    rows = {}
    with tempfile.TemporaryDirectory(prefix="bench-regen-") as work:
        for e in a.engines.split(","):
            log.info("engine %s: %d prompts, batch %d, %d new tokens at most", e, len(prompts), a.batch, a.max_new_tokens)
            rows[e] = {"vllm": lambda: run_vllm(a, tok, prompts, Path(work), log),
                       "runtime": lambda: run_runtime(a, tok, prompts, log), "hf": lambda: run_hf(a, tok, prompts)}[e]()
    base = (rows.get("runtime") or {}).get("new_tokens_per_s")
    for r in rows.values():
        r["ratio_to_runtime"] = round(r["new_tokens_per_s"] / base, 2) if base and r["new_tokens_per_s"] else None
    if "runtime" in rows:
        for r in rows.values():
            r["answers_equal_runtime"] = sum(x == y for x, y in zip(r["answers"], rows["runtime"]["answers"], strict=True))
    out = {"prompts": len(prompts), "batch": a.batch, "max_new_tokens": a.max_new_tokens, "threads": a.threads,
           "model": str(a.model), "engines": {e: {k: v for k, v in r.items() if k != "answers"} for e, r in rows.items()}}
    print(f"{'engine':34} {'new tok':>8} {'gen s':>8} {'load s':>7} {'tok/s':>8} {'x runtime':>9} {'=runtime':>8}")
    for r in out["engines"].values():
        print(f"{r['engine']:34} {r['new_tokens']:>8} {r['seconds']:>8} {r['load_seconds']:>7} {r['new_tokens_per_s']:>8} "
              f"{r['ratio_to_runtime']!s:>9} {r.get('answers_equal_runtime', '-')!s:>8}")
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
