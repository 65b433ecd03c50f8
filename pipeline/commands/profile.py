"""`specpipe profile`: the target's (and draft's) layer shapes measured on this machine and the cost model fitted
to them (runtime/cost/profile.py), with a summary of the fit."""
from __future__ import annotations

from pathlib import Path

from pipeline.device import resolve_device
from pipeline.errors import UsageError


def parse_rows(rows: str) -> list[int]:
    """--rows: the token rows M to measure, comma-separated positive integers."""
    try:
        ms = sorted({int(x) for x in rows.split(",") if x.strip()})
    except ValueError:
        raise UsageError(f"--rows {rows}: expected comma-separated integers") from None
    if not ms or ms[0] < 1:
        raise UsageError(f"--rows {rows}: expected positive integers")
    return ms


def profile_shapes(cfg, artifacts: Path):
    """The shapes `specpipe profile` measures: the committed target's (and draft's, once trained), else, for the
    built-in tiny target, its config section's. UsageError when neither is available."""
    from pipeline.artifacts import target as target_artifact
    from pipeline.artifacts import train_draft as train_draft_artifact
    from runtime.cost import profile as P
    from runtime.cost.costmodel import llama

    tart, dart = artifacts / "target", artifacts / "train_draft"
    if (tart / "manifest.json").is_file() and (tart / target_artifact.INFO).is_file():
        tinfo, src = target_artifact.read_info(tart), str(tart / target_artifact.INFO)
        draft = dcfg = None
        if (dart / "manifest.json").is_file() and (dart / train_draft_artifact.INFO).is_file() \
                and (train_draft_artifact.draft_dir(dart) / "config.json").is_file():
            draft, dcfg = train_draft_artifact.read_info(dart), train_draft_artifact.read_draft_config(dart)
            src += f", {dart / train_draft_artifact.INFO}"
        return P.shapes_from_artifacts(tinfo, draft, dcfg and dcfg.raw), src
    if cfg.target.bootstrap == "tiny":
        t = cfg.target.tiny
        return {"target": llama("target", num_layers=t.num_layers, hidden=t.hidden_size, heads=t.num_heads,
                                kv_heads=t.num_kv_heads, intermediate=t.intermediate_size, vocab=t.vocab_size)}, \
            "target.tiny (no target artifact yet)"
    raise UsageError(f"no committed target artifact in {artifacts}: run `specpipe build CONFIG --only target` "
                     "first (the profile measures the target's layer shapes)")


def measure(cfg, artifacts: Path, *, rows: list[int], context: int, rounds: int, dtype: str, echo) -> tuple[dict, str]:
    """Measure every shape and fit the machine; returns (the profile document, the GEMM dtype measured)."""
    from runtime.cost import profile as P

    shapes, source = profile_shapes(cfg, artifacts)
    device = resolve_device(cfg.run).torch
    gemm_dtype = P.resolve_gemm_dtype(device, dtype)
    import torch

    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    echo(f"profiling {', '.join(shapes)} ({source}) on {P.device_name(device)}, {gemm_dtype} GEMMs, "
         f"{torch.get_num_threads()} threads, context {context}, {rounds} round(s)", err=True)
    doc = P.profile(shapes, device=device, gemm_dtype=gemm_dtype, rows=rows, context=context, rounds=rounds,
                    progress=lambda r, key, q, m, t: echo(
                        f"  round {r + 1} {key} M={m:<5d} q={q} {t * 1e3:9.3f} ms", err=True))
    return doc, gemm_dtype


def summary(doc: dict, gemm_dtype: str) -> list[str]:
    """The fitted machine and, per model, measured against predicted step times."""
    m = doc["machine"]
    lines = [
        f"machine: GEMM {m['peak_tflops'][gemm_dtype] * 1e3:.1f} GFLOP/s, {m['bandwidth_tb_s'] * 1e3:.1f} GB/s "
        f"(cache {m['cache_bandwidth_tb_s'] * 1e3:.1f}), attention {m['attn_bandwidth_tb_s'] * 1e3:.1f} GB/s / "
        f"{m['attn_tflops'] * 1e3:.1f} GFLOP/s, overlap p={m['overlap']:.2f}, {m['op_overhead_us']:.1f} us/op; "
        f"ridge {doc['ridge_rows']:.1f} rows",
        "weight streaming by working set: " + ", ".join(
            f"{w / 2**20:.0f} MiB {b * 1e3:.1f} GB/s" for w, b in m.get("footprint_bandwidth_tb_s") or []),
        "GEMM time factor by rows: " + ", ".join(f"M={r} {f:.2f}" for r, f in m.get("gemm_row_factors") or []),
    ]
    for key, mod in doc["models"].items():
        lines.append(f"{key}: {'M':>5s} {'q':>2s} {'measured ms':>12s} {'predicted ms':>13s} {'error':>7s}")
        for p in mod["points"]:
            lines.append(f"{'':{len(key) + 1}s} {p['rows']:5d} {p['q_len']:2d} {p['measured_ms']:12.3f} "
                         f"{p['predicted_ms']:13.3f} {100 * p['error']:+6.1f}%")
        lines.append(f"{key}: mean |error| {100 * mod['mean_abs_error']:.1f}%, max {100 * mod['max_abs_error']:.1f}%")
    return lines
