"""Precision by machine: what `auto` picks here and what each dtype costs, measured side by side in one process.

1. The GEMM `runtime.engine.precision` decides by (1280 x 576 x 1536, one thread, fp32 and bf16 interleaved) and
   the decision (`auto` -> bfloat16 or float32), measured afresh (and cached, as a build would).
2. Draft training steps of a real config (default: configs/smollm2_fp8_eagle3.yaml) with the frozen target in each
   `train_draft.target_dtype`, one model per dtype, their steps interleaved (fp32 step, bf16 step, fp32 step, ...)
   so that other load on the machine falls on both alike; the median step after the first, their ratio, and the
   training time of the config's steps at that rate.

Needs a workdir whose `target` and `data` stages are committed (e.g. `specpipe build CONFIG --only target`, then
`--only data`). A CPU without native bf16 can be emulated on one that has it: oneDNN and ATen capped at AVX2
(`ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`), where bf16 GEMMs are emulated; there a bf16 step takes
minutes, so bf16 steps stop after `--max-slow-s` of them.

    OMP_NUM_THREADS=2 python bench/precision.py --workdir runs/smollm2_fp8_eagle3 --steps 5
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 OMP_NUM_THREADS=2 python bench/precision.py --workdir ... --steps 5
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _job(config: Path, workdir: Path, scratch: Path, target_dtype: str, extra: list[str]) -> dict:
    """The stage's own job for `target_dtype` (stages.train_draft.make_job on the committed target and data)."""
    from pipeline.config import load_config
    from pipeline.device import resolve_device
    from pipeline.stage import StageContext
    from pipeline.store import Store
    from stages import train_draft as td

    cfg = load_config(config, [f"train_draft.target_dtype={target_dtype}", "run.device=cpu", *extra])
    st = Store(workdir)
    out = scratch / f"out_{target_dtype}"
    out.mkdir(parents=True, exist_ok=True)
    (scratch / "job").mkdir(exist_ok=True)
    ctx = StageContext(name="train_draft", config=cfg, section=cfg.train_draft, out_dir=out,
                       scratch_dir=scratch / "job", inputs={k: st.artifact(k) for k in ("target", "data")},
                       workdir=workdir, fingerprint="0" * 16, log=logging.getLogger("bench.precision"),
                       device=resolve_device(cfg.run))
    return td.make_job(ctx)


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, help="a workdir with target and data committed (without: the GEMM only)")
    ap.add_argument("--config", type=Path, default=REPO / "configs" / "smollm2_fp8_eagle3.yaml")
    ap.add_argument("--steps", type=int, default=5, help="steps per dtype (the first is a warm-up)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-slow-s", type=float, default=240.0, help="stop a dtype's steps once they took this long")
    ap.add_argument("-o", dest="overrides", action="append", default=[], help="config overrides, as specpipe's -o")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="target dtypes to step, comma-separated")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    return ap.parse_args(argv)


def _interleaved_steps(a, scratch: Path) -> tuple[dict, dict]:
    """One model per target dtype, their optimizer steps interleaved. Returns ({dtype: [seconds]}, the job's train)."""
    from runtime.training.dist import start_process
    from runtime.training.loop import _optimizer_step, setup_training
    from runtime.training.samples import batch_indices, calibrate_d2t_once, read_training_data

    runs, steps = {}, {}
    for d in a.dtypes.split(","):
        job = _job(a.config, a.workdir.resolve(), scratch, d, ["train_draft.eval.prompts_per_domain=0", *a.overrides])
        job["threads"] = a.threads
        proc = start_process(job, None)
        data = read_training_data(job, 1)
        calibrate_d2t_once(job, data.samples, proc)
        runs[d] = (job, data, proc, setup_training(job, False, scratch / f"ckpt_{d}", proc))
        steps[d] = []
    t = next(iter(runs.values()))[0]["train"]
    for step in range(a.steps):
        for d, (job, data, proc, run) in runs.items():
            if sum(steps[d]) > a.max_slow_s:
                continue
            batch = data.batch(batch_indices(step, len(data.samples), t["batch_size"], t["seed"]), t["seq_len"], proc.device)
            t0 = time.perf_counter()
            _optimizer_step(job, run, batch, proc)
            steps[d].append(round(time.perf_counter() - t0, 3))
            print(f"step {step + 1} target {d}: {steps[d][-1]:.2f} s", flush=True)
    return steps, t


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)

    import torch

    from runtime.engine.precision import cpu_precision, resolve_precision

    p = cpu_precision(refresh=True)
    auto = resolve_precision("auto", "cpu", p)
    print(f"GEMM: {p.describe()}; auto -> {auto}", flush=True)
    torch.set_num_threads(a.threads)
    res: dict = {"cpu": p.record(), "auto": auto, "threads": a.threads, "torch": torch.__version__}
    if a.workdir is not None:
        with tempfile.TemporaryDirectory(prefix="specpipe-precision-") as tmp:
            res["steps"], t = _interleaved_steps(a, Path(tmp))
        med = {d: statistics.median(v[1:] or v) for d, v in res["steps"].items() if v}
        res["median_s"] = {d: round(v, 3) for d, v in med.items()}
        res["bf16_over_fp32"] = round(med["bfloat16"] / med["float32"], 3) if len(med) == 2 else None
        res["train_min"] = {d: round(v * t["steps"] / 60, 1) for d, v in med.items()}
        res["auto_median_s"] = res["median_s"].get(auto)
        for d, v in med.items():
            print(f"target_dtype {d}: median {v:.2f} s a step (of {len(res['steps'][d])}) -> {t['steps']} steps "
                  f"~{res['train_min'][d]:.1f} min")
        if len(med) == 2:
            print(f"bf16 / fp32 step time: {res['bf16_over_fp32']:.2f}; auto -> {auto}: {med[auto]:.2f} s a step "
                  f"({'the faster' if med[auto] <= min(med.values()) else 'NOT the faster'} of the two)")
    if a.json:
        a.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
