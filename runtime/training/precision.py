"""The training dtypes on this machine: `auto` resolved for the fingerprint (`resolved_dtypes`), the stage's log
line and warning (`log_precision`), the report's row (`precision_row`). The decision itself is
runtime.engine.precision's; the rule (which dtype auto takes where) is runtime.training.job.resolve_dtypes."""
from __future__ import annotations

from runtime.training.job import JobError, needs_machine, resolve_dtypes


def resolved_dtypes(section, device_type) -> dict:
    """{train_dtype, target_dtype} of the section, auto resolved on this machine (`device_type()`: the device the
    stages will run on, asked only where an auto needs it; the CPU's decision is read from its cache, measured once
    per machine where there is none). Empty for a combination `check` refuses."""
    try:
        train_dtype, tgt_dtype = resolve_dtypes(section, device_type() if needs_machine(section) else "cpu")
    except JobError:
        return {}
    return {"train_dtype": train_dtype, "target_dtype": tgt_dtype}


def log_precision(log, job: dict, dtype: str, target_dtype: str) -> dict:
    """Log how the job's dtypes were chosen from the configured `dtype` / `target_dtype`, and warn about an explicit
    bf16 on a CPU where it is slow; the CPU's precision record for the stage's metrics (empty on CUDA)."""
    from runtime.engine.precision import cpu_precision, slow_bf16_warning

    if job["device"] != "cpu":
        return {}
    p = cpu_precision()
    log.info("precision: %s; bf16 %s here -> train_draft.target_dtype %s resolves to %s", p.describe(),
             "fast" if p.bf16_fast else "not fast", target_dtype, job["target_dtype"])
    if "bfloat16" in (target_dtype, dtype) and (msg := slow_bf16_warning(
            "train_draft.target_dtype" if target_dtype == "bfloat16" else "train_draft.dtype", p)):
        log.warning("%s", msg)
    return {"cpu_bf16_fast": p.bf16_fast, "cpu_native_bf16": p.native_bf16, "cpu_capability": p.capability,
            "cpu_bf16_over_fp32": p.bf16_over_fp32}


def precision_row(m: dict) -> str:
    """The report's "precision" row from the stage's metrics."""
    if not m.get("target_dtype"):
        return "not recorded"
    out = f"training {m['train_dtype']}, target {m['target_dtype']}"
    if m.get("cpu_capability"):
        out += (f" (CPU {m['cpu_capability']}, native bf16 {'yes' if m.get('cpu_native_bf16') else 'no'}, "
                f"bf16 GEMM {m.get('cpu_bf16_over_fp32')}x fp32's time)")
    return out


def plan_line(job: dict, launcher: str) -> str:
    """The stage's opening log line: what trains, how long, where, in which dtypes."""
    a, t = job["algorithm"], job["train"]
    dtypes = job["train_dtype"] + (f", target {job['target_dtype']} under autocast"
                                   if job["target_dtype"] != job["train_dtype"] else "")
    steps = f"{t['steps']} steps" + (f" (fewer where they take over max_minutes {t['max_minutes']:g})"
                                      if t.get("max_minutes") else "")
    return (f"{a['name']} draft, {a['draft_layers']} layer(s), {job['mode']} mode, {steps} of batch "
            f"{t['batch_size']} x {t['seq_len']} tokens on {job['device']} ({dtypes}), launcher {launcher}"
            + (" with the target's layers sharded (FSDP)" if job["fsdp"] else ""))
