"""Where a decoding step's time goes on the real model: target forwards of M tokens and draft steps, per compute
mode, side by side in one run (every configuration timed in turn, round after round, so a load change hits all
of them alike; medians and the spread over rounds are reported).

    python bench/real_model/bench_steps.py --threads 2 [--baseline-rev 787571e] [--fp8-target DIR]
        [--eagle3 DIR] [--dflash DIR] [--context 512] [--rows 1,2,4,5,8] [--batch4] [--json out.json]

Targets: the BF16 checkpoint (default: the prepared SmolLM2, `$SPECPIPE_REAL_DIR`) and, with --fp8-target, a
ModelOpt FP8 export of it. Runners: `fp32` and `bf16` (`runtime.engine.target.TargetRunner(compute=...)`; bf16 only
where the runtime's `auto` takes it, as the stages do: native bf16 GEMMs AND measured faster than fp32 on this machine,
`runtime.engine.precision.cpu_precision`, cached per machine; unless --force-bf16) and, with
--baseline-rev, the runtime as it was at that git revision (its whole runtime/ tree, imported as `_base_runtime`;
pipeline/ and the model loading are today's code).

Each target point is one forward of M new tokens per row at a context of --context tokens (KV cache filled with
random values: attention cost depends on shapes only), batch 1 (and batch 4 with --batch4). For today's runners
the time is split into: GEMMs (the runner's own fused GEMMs over all layers and the lm_head, run alone on
inputs of the same shape), attention (the same SDPA calls alone), and the rest (norms, RoPE, residual adds,
cache writes, dtype conversions, Python and dispatch: the per-op overhead). `GB/s` is the weight bytes the GEMMs
read divided by their time; `stream` is the machine's read bandwidth measured here (a sum over a 1 GiB tensor),
so bytes / stream is the floor weight streaming puts under a forward.

Draft points: EAGLE-3, one step's draft work (a pass over 2 newly verified positions + k-1 single-token chain
passes, the EAGLE-3 drafter's `propose`) and one chain pass alone; DFlash, one step (context update of 2
positions + the block pass). Prints Markdown tables.
"""
from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


# Where each name this bench uses is defined (the modules runtime/engine/speculative.py was split into); a revision
# whose speculative module still re-exported them gets them from there.
PARTS = {"TargetRunner": "engine.target", "target_shape": "engine.target", "make_drafter": "engine.drafters",
         "load_draft": "engine.drafts"}


def runtime_api(package: str, speculative=None) -> SimpleNamespace:
    """`TargetRunner`, `target_shape`, `make_drafter`, `load_draft` of the runtime package `package` (`runtime`, or
    `_base_runtime` for a baseline revision), from its speculative module where that has them."""
    return SimpleNamespace(**{n: getattr(speculative, n, None) or getattr(importlib.import_module(f"{package}.{m}"), n)
                              for n, m in PARTS.items()})


def load_baseline(rev: str) -> SimpleNamespace:
    """The speculative runtime of git revision `rev` (`runtime_api`): that revision's whole runtime/ tree, extracted
    (`git archive`) and imported as the package `_base_runtime`, so its modules import each other whatever its layout
    was (runtime/speculative.py before the runtime/ subpackages, runtime/engine/speculative.py and its parts after)."""
    d = Path(tempfile.mkdtemp(prefix="specpipe-base-"))
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", rev, "runtime"], capture_output=True)
    if archive.returncode != 0:
        raise SystemExit(f"--baseline-rev {rev}: git archive failed: {archive.stderr.decode(errors='replace').strip()}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(d, filter="data")
    (d / "runtime").rename(d / "_base_runtime")
    for f in (d / "_base_runtime").rglob("*.py"):
        src = re.sub(r"(?m)^(\s*)(from|import) runtime\b", r"\1\2 _base_runtime", f.read_text())
        f.write_text(re.sub(r"(?<![\w.])runtime\.", "_base_runtime.", src))
    sys.path.insert(0, str(d))
    for name in ("_base_runtime.engine.speculative", "_base_runtime.speculative"):   # after / before the layout
        if (d / (name.replace(".", "/") + ".py")).is_file():
            return runtime_api("_base_runtime", importlib.import_module(name))
    raise SystemExit(f"--baseline-rev {rev}: no runtime/speculative.py nor runtime/engine/speculative.py there")


def interleaved(fns: dict, rounds: int, inner: int) -> dict[str, list[float]]:
    """Seconds per call of each function: `rounds` rounds, each timing every function over `inner` calls after one
    warm-up call, in turn."""
    out = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            f()
            t0 = time.perf_counter()
            for _ in range(inner):
                f()
            out[k].append((time.perf_counter() - t0) / inner)
    return out


def stream_bandwidth(rounds: int = 5) -> float:
    """Read bandwidth (bytes/s): sum over a 1 GiB float32 tensor, best of `rounds`."""
    import torch

    x = torch.ones(2 ** 28)
    x.sum()
    best = min(_t(lambda: x.sum()) for _ in range(rounds))
    return x.numel() * 4 / best


def _t(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def fill_cache(runner, batch: int, context: int, extra: int) -> None:
    import torch

    runner.reset(batch, context + extra)
    g = torch.Generator().manual_seed(0)
    for t in runner.cache.k + runner.cache.v:
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    runner.cache.lengths = torch.full((batch,), context, dtype=torch.long)


def parts(runner, batch: int, m: int, context: int):
    """Callables running, for a forward of m tokens per row: all of the runner's GEMMs alone, and its attention
    calls alone; and the weight bytes the GEMMs read."""
    import torch

    from runtime.engine.layers import attention, causal_mask

    plan = runner.plan
    g = torch.Generator().manual_seed(1)
    gemms = []
    for L in plan.layers:
        gemms += [L.qkv, L.o, L.gate_up, L.down]
    gemms.append(plan.head)
    xs = [torch.randn(batch, m, G.in_features, generator=g) for G in gemms]
    nbytes = sum(G.w.numel() * G.w.element_size() for G in gemms if G.kind is not None)
    pos = torch.full((batch,), context)[:, None] + torch.arange(m)[None]
    kv_len = context + m
    mask = causal_mask(pos, kv_len)
    L0 = plan.layers[0]
    q = torch.randn(batch, L0.nq, m, L0.hd, generator=g)
    a = runner.layers[0].self_attn

    def run_gemms():
        for G, x in zip(gemms, xs, strict=True):
            G(x)

    def run_attention():
        for i in range(len(plan.layers)):
            attention(q, runner.cache.k[i].narrow(2, 0, kv_len), runner.cache.v[i].narrow(2, 0, kv_len), mask, a.scaling)

    return run_gemms, run_attention, nbytes


def target_table(label: str, runners: dict, points: list[tuple[int, int]], context: int, rounds: int, inner: int,
                 bw: float, k: int) -> list[dict]:
    import torch

    rows = []
    for batch, m in points:
        toks = torch.randint(0, 49152, (batch, m), generator=torch.Generator().manual_seed(2))
        fns = {}
        for name, r in runners.items():
            fill_cache(r, batch, context, m + k + 2)
            fns[name] = (lambda r=r, toks=toks: r.forward(toks))
            if hasattr(r, "plan"):
                ge, at, nbytes = parts(r, batch, m, context)
                fns[f"{name}:gemm"], fns[f"{name}:attn"] = ge, at
                r._bytes = nbytes
        with torch.no_grad():
            t = interleaved(fns, rounds, inner)
        row = {"target": label, "batch": batch, "m": m}
        for name, r in runners.items():
            med = statistics.median(t[name])
            row[name] = {"ms": 1e3 * med, "min": 1e3 * min(t[name]), "max": 1e3 * max(t[name])}
            if hasattr(r, "plan"):
                ge, at = statistics.median(t[f"{name}:gemm"]), statistics.median(t[f"{name}:attn"])
                row[name].update({"gemm_ms": 1e3 * ge, "attn_ms": 1e3 * at, "rest_ms": 1e3 * (med - ge - at),
                                  "gemm_GBps": r._bytes / ge / 1e9, "stream_floor_ms": 1e3 * r._bytes / bw,
                                  "weight_MB": r._bytes / 1e6})
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


@dataclass(frozen=True)
class Repeats:
    """How each step is timed (`interleaved`): `rounds` rounds of `inner` calls each."""

    rounds: int
    inner: int


def draft_table(model, draft_dirs: dict, modes: list[str], context: int, k: int, repeats: Repeats,
                base=None, batch: int = 1) -> list[dict]:
    import torch

    from runtime.algorithms.registry import get as get_algorithm

    now = runtime_api("runtime")
    rows = []
    for algo, path in draft_dirs.items():
        fns = {}
        for mode in (["base"] if base else []) + modes:
            rt = base if mode == "base" else now
            draft = rt.load_draft(path, now.target_shape(model))
            chain = not get_algorithm(draft.algorithm).drafts_block     # (the base runtime's drafts may predate traits)
            caps = draft.aux_layer_ids if chain else draft.target_layer_ids
            r = rt.TargetRunner(model, caps) if mode == "base" else rt.TargetRunner(model, caps, compute=mode)
            dr = rt.make_drafter(draft, r)
            dr.reset(batch, context + 64)
            H = model.config.hidden_size
            g = torch.Generator().manual_seed(3)
            hid = torch.randn(batch, context, len(caps) * H, generator=g)
            ids = torch.randint(0, 49152, (batch, context), generator=g)
            with torch.no_grad():
                dr.observe(hid, ids, torch.full((batch,), context))
                if chain:
                    dr.propose(ids[:, -1], 1, 0.0, None)      # the draft cache now holds the context
            base_len = dr.cache.lengths.clone()

            def step(dr=dr, base_len=base_len, hid=hid, ids=ids):
                dr.cache.lengths = base_len.clone()
                dr.observe(hid[:, :2], ids[:, :2], torch.full((batch,), 2))
                dr.propose(ids[:, -1], k, 0.0, None)

            fns[f"{mode}:step"] = step
            if chain:
                pre = torch.randn(batch, 1, H, generator=g)
                emb = r.embed(ids[:, :1]).float()
                extra = () if mode == "base" else (mode,)

                def chain(d=draft, dr=dr, pre=pre, emb=emb, pos=base_len[:, None], u=int(base_len[0]), extra=extra):
                    d.step(pre, emb, dr.cache, pos, u, *extra)

                fns[f"{mode}:chain_pass"] = chain
        with torch.no_grad():
            t = interleaved(fns, repeats.rounds, repeats.inner)
        for name, v in t.items():
            mode, what = name.split(":")
            row = {"draft": algo, "mode": mode, "what": what, "k": k, "context": context, "batch": batch,
                   "ms": 1e3 * statistics.median(v), "min": 1e3 * min(v), "max": 1e3 * max(v)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def markdown(trows: list[dict], drows: list[dict], names: list[str]) -> str:
    out = []
    if trows:
        head = "| target | B x M | " + " | ".join(f"{n} ms" for n in names) + " | " + \
               " | ".join(f"{n}/{names[0]}" for n in names[1:]) + " | " + \
               " | ".join(f"{n}: GEMM / attn / rest ms, GB/s, floor ms" for n in names if n != "base") + " |"
        out += [head, "|" + "---|" * (head.count("|") - 1)]
        for r in trows:
            cells = [r["target"], f"{r['batch']} x {r['m']}"]
            cells += [f"{r[n]['ms']:.2f} [{r[n]['min']:.1f}-{r[n]['max']:.1f}]" for n in names]
            cells += [f"{r[n]['ms'] / r[names[0]]['ms']:.2f}" for n in names[1:]]
            cells += [f"{r[n]['gemm_ms']:.1f} / {r[n]['attn_ms']:.1f} / {r[n]['rest_ms']:.1f}, "
                      f"{r[n]['gemm_GBps']:.1f}, {r[n]['stream_floor_ms']:.1f}" for n in names if n != "base"]
            out.append("| " + " | ".join(cells) + " |")
    if drows:
        out += ["", "| draft | what | mode | k | ms [min-max] |", "|---|---|---|---|---|"]
        for r in drows:
            out.append(f"| {r['draft']} | {r['what']} | {r['mode']} | {r['k']} | {r['ms']:.2f} [{r['min']:.2f}-{r['max']:.2f}] |")
    return "\n".join(out)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    real = Path(os.environ.get("SPECPIPE_REAL_DIR", REPO / "bench" / "real_model" / "prepared"))
    ap.add_argument("--target", type=Path, default=real / "model" / "SmolLM2-135M-Instruct")
    ap.add_argument("--fp8-target", type=Path)
    ap.add_argument("--eagle3", type=Path)
    ap.add_argument("--dflash", type=Path)
    ap.add_argument("--baseline-rev", help="also time the runtime as it was at this git revision")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--rows", default="1,2,4,5,8", help="tokens per forward at batch 1")
    ap.add_argument("--batch4", action="store_true", help="also batch 4 at 1 and k+1 tokens per row")
    ap.add_argument("--draft-len", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--inner", type=int, default=3)
    ap.add_argument("--force-bf16", action="store_true", help="time the bf16 mode even where auto leaves it out")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)

    import torch

    from runtime.engine.compute import default_modes, native_bf16_gemm, resolve_compute
    from runtime.engine.precision import cpu_precision
    from runtime.engine.target import TargetRunner, load_target

    auto = resolve_compute("auto")   # the stages' decision: bf16 only where native and measured faster here
    print(f"precision: {cpu_precision().describe()}; compute auto -> {auto}", flush=True)
    torch.set_num_threads(a.threads)
    modes = default_modes(a.force_bf16)
    base = load_baseline(a.baseline_rev) if a.baseline_rev else None
    bw = stream_bandwidth()
    k = a.draft_len
    points = [(1, int(m)) for m in a.rows.split(",")] + ([(4, 1), (4, k + 1)] if a.batch4 else [])
    meta = {"threads": a.threads, "context": a.context, "draft_len": k, "modes": modes, "baseline_rev": a.baseline_rev,
            "native_bf16_gemm": native_bf16_gemm(), "compute_auto": auto, "precision": cpu_precision().record(),
            "stream_GBps": bw / 1e9, "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "load_before": os.getloadavg(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    print(json.dumps(meta), flush=True)
    trows, drows = [], []
    targets = [("bf16 ckpt", a.target)] + ([("fp8 ckpt", a.fp8_target)] if a.fp8_target else [])
    for label, path in targets:
        model = load_target(path)
        runners = ({"base": base.TargetRunner(model)} if base else {})
        runners |= {m: TargetRunner(model, compute=m) for m in modes}
        trows += target_table(label, runners, points, a.context, a.rounds, a.inner, bw, k)
        if label == "bf16 ckpt":
            drafts = {n: p for n, p in (("eagle3", a.eagle3), ("dflash", a.dflash)) if p}
            drows += draft_table(model, drafts, modes, a.context, k, Repeats(a.rounds, max(a.inner, 5)), base)
        del runners, model
    meta["load_after"] = os.getloadavg()
    names = (["base"] if base else []) + modes
    md = markdown(trows, drows, names)
    print(f"\nthreads {a.threads}, context {a.context}, read bandwidth {bw / 1e9:.1f} GB/s, load {meta['load_before']} "
          f"-> {meta['load_after']}\n")
    print(md)
    res = {"meta": meta, "target": trows, "draft": drows, "markdown": md}
    if a.json:
        a.json.write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
