"""The runtime's compute modes: `fp32` (exact), `bf16` (bf16 GEMMs, float32 elsewhere) and `auto` (`bf16` only
where this machine runs bf16 GEMMs natively and measurably faster: `runtime.engine.precision.cpu_precision`)."""
from __future__ import annotations

import logging

import torch

COMPUTE_MODES = ("fp32", "bf16", "auto")


def native_bf16_gemm(device="cpu") -> bool:
    """Whether bf16 GEMMs run natively here (the capability check, `runtime.engine.precision.native_bf16`)."""
    from runtime.engine.precision import native_bf16

    return native_bf16(device)


def default_modes(force_bf16: bool = False) -> list[str]:
    """The compute modes a benchmark times by default (bench/real_model/bench_steps.py, bench_e2e.py): `fp32`, and `bf16`
    where `auto` takes it on this CPU, the stages' decision (not the capability check alone), or where forced."""
    return ["fp32"] + (["bf16"] if force_bf16 or resolve_compute("auto") == "bf16" else [])


def resolve_compute(compute: str, device="cpu") -> str:
    """`fp32` | `bf16` from a requested mode. `fp32`: the exact mode, every GEMM in the loaded parameters' dtype
    (float32 as the loaders give it). `bf16`: GEMMs take bf16 weights and bf16-rounded activations (float32
    accumulation), everything else (residual stream, norms, RoPE, attention, KV cache) stays float32. `auto`:
    `bf16` on a CPU with native bf16 GEMMs (`native_bf16_gemm`) that also measured faster than fp32 there
    (`runtime.engine.precision.cpu_precision`, cached per machine), `fp32` otherwise (and on CUDA, where the exact
    mode is what `validate` compares against)."""
    if compute not in COMPUTE_MODES:
        raise ValueError(f"compute must be one of {COMPUTE_MODES}, not {compute!r}")
    if compute == "auto":
        dev = torch.device(device)
        if dev.type != "cpu" or not native_bf16_gemm(dev):
            return "fp32"
        from runtime.engine.precision import cpu_precision

        return "bf16" if cpu_precision().bf16_fast else "fp32"
    if compute == "bf16" and torch.device(device).type == "cpu":
        from runtime.engine.precision import cpu_precision, slow_bf16_warning

        if msg := slow_bf16_warning("compute mode bf16", cpu_precision()):
            logging.getLogger("specpipe").warning("%s", msg.replace("set it to auto (float32", "use compute auto (fp32"))
    return compute
