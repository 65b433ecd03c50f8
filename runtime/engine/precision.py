"""Which compute dtype this machine runs fastest: bf16 GEMMs only where the CPU runs them natively fast.

A bf16 GEMM is fast on a CPU with AMX-BF16 or AVX512-BF16 (oneDNN's native kernels: ~2-3x fp32's rate) and slow
everywhere else (emulated: 2x slower with AVX-512 but no bf16 dot products, 7-40x slower on AVX2; docs/benchmarks.md
"Precision by machine"). `cpu_precision()` decides once per machine, by the capability check
(`native_bf16`) AND a short measured GEMM, fp32 and bf16 side by side on one thread
(`SHAPE`: SmolLM2-135M's MLP GEMM at 4 x 320 training tokens), and caches the decision in
`~/.cache/specpipe/precision.json` (`$SPECPIPE_CACHE_DIR` moves it) under a key of what decides it: the CPU's model
name and flags, the torch version, and the environment variables that cap the ISA torch and oneDNN use. Reading a
cached decision imports nothing heavy (no torch): the fingerprints of a no-op rebuild read it.

`auto` resolves to bf16 on CUDA, and on a CPU only where bf16 is native AND measured at most `MARGIN` of fp32's time:
it never picks the slower dtype, and a near tie stays fp32 (exact, and the same artifacts as before).
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

SHAPE = (1280, 576, 1536)   # rows x in x out: SmolLM2-135M's MLP up-projection at batch 4 x 320 tokens
MARGIN = 0.9                # bf16 must take at most this fraction of fp32's time
ISA_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
PRECISION_CHOICES = ("auto", "bfloat16", "float32")


@dataclass(frozen=True)
class CpuPrecision:
    """The decision for this CPU and how it was reached (what provenance and the report record)."""

    bf16_fast: bool            # auto resolves to bfloat16 here
    native_bf16: bool          # the capability check: AMX-BF16 / AVX512-BF16 with oneDNN's bf16 kernels
    capability: str            # torch.backends.cpu.get_cpu_capability()
    fp32_ms: float             # the SHAPE GEMM, one thread, best of the interleaved repetitions
    bf16_ms: float
    cpu: str                   # the CPU's model name
    key: str                   # the cache key
    measured: str              # when (ISO time)
    source: str = "measured"   # measured | cache

    @property
    def bf16_over_fp32(self) -> float:
        """bf16's time over fp32's: above 1, bf16 is that many times slower."""
        return round(self.bf16_ms / self.fp32_ms, 3) if self.fp32_ms else float("nan")

    def record(self) -> dict:
        return {**asdict(self), "bf16_over_fp32": self.bf16_over_fp32, "shape": list(SHAPE), "margin": MARGIN}

    def describe(self) -> str:
        return (f"{self.cpu or 'this CPU'} ({self.capability}, native bf16 {'yes' if self.native_bf16 else 'no'}): "
                f"{SHAPE[0]}x{SHAPE[1]}x{SHAPE[2]} GEMM fp32 {self.fp32_ms:.1f} ms, bf16 {self.bf16_ms:.1f} ms "
                f"({self.bf16_over_fp32:.2f}x), {self.source}")


def cache_path() -> Path:
    base = os.environ.get("SPECPIPE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "specpipe")
    return Path(base) / "precision.json"


def _cpuinfo() -> tuple[str, str]:
    """(model name, flags) of the first CPU in /proc/cpuinfo; the platform's processor string elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return platform.processor() or platform.machine(), ""
    name = flags = ""
    for line in text.splitlines():
        k, _, v = line.partition(":")
        k = k.strip()
        if k == "model name" and not name:
            name = v.strip()
        elif k in ("flags", "Features") and not flags:
            flags = v.strip()
        if name and flags:
            break
    return name or platform.machine(), flags


def machine_key() -> str:
    """What decides the choice, hashed: CPU model and flags, torch's version, the ISA caps in the environment."""
    name, flags = _cpuinfo()
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = None
    doc = {"cpu": name, "flags": " ".join(sorted(flags.split())), "machine": platform.machine(),
           "torch": torch_version, "env": {k: os.environ.get(k) for k in ISA_ENV}, "shape": SHAPE, "margin": MARGIN}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:20]


def _read_cache() -> dict:
    try:
        doc = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _write_cache(key: str, rec: dict) -> None:
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = _read_cache()
        doc[key] = rec
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(doc, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:   # a read-only home: the decision is measured again next time, nothing else changes
        pass


def measure_gemm(reps: int = 5) -> tuple[float, float]:
    """(fp32 ms, bf16 ms) of the SHAPE GEMM on one thread, interleaved, best of `reps` each. A bf16 GEMM more than
    5x slower than fp32 (emulated) is timed once: its slowdown is plain and each call may take a second."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        m, k, n = SHAPE
        g = torch.Generator().manual_seed(0)
        a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
        ab, bb = a.bfloat16(), b.bfloat16()
        a @ b, ab @ bb     # warm-up (oneDNN's kernels are created on first use)
        f32, b16 = [], []
        for _ in range(reps):
            t = time.perf_counter()
            a @ b
            f32.append(time.perf_counter() - t)
            t = time.perf_counter()
            ab @ bb
            b16.append(time.perf_counter() - t)
            if b16[-1] > 5 * f32[-1]:
                break
        return 1e3 * min(f32), 1e3 * min(b16)
    finally:
        torch.set_num_threads(threads)


def native_bf16(device="cpu") -> bool:
    """Whether bf16 GEMMs run natively here (detected, not assumed): on CPU, oneDNN with AMX-BF16 or AVX512-BF16
    dot-product instructions (without them oneDNN emulates bf16 and fp32 is faster); on CUDA, bf16 support."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if dev.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    cpu = torch.cpu
    isa = (getattr(cpu, "_is_amx_tile_supported", lambda: False)()
           or getattr(cpu, "_is_avx512_bf16_supported", lambda: False)())
    return bool(isa and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def cpu_precision(*, refresh: bool = False) -> CpuPrecision:
    """This CPU's decision: from the cache when it holds one for `machine_key()`, else measured (~1 s) and cached."""
    key = machine_key()
    if not refresh:
        rec = _read_cache().get(key)
        if isinstance(rec, dict):
            try:
                fields = {f: rec[f] for f in CpuPrecision.__dataclass_fields__ if f != "source"}
                return CpuPrecision(**fields, source="cache")
            except (KeyError, TypeError):
                pass
    import torch

    native = native_bf16("cpu")
    fp32_ms, bf16_ms = measure_gemm()
    p = CpuPrecision(bf16_fast=bool(native and bf16_ms <= MARGIN * fp32_ms), native_bf16=bool(native),
                     capability=str(torch.backends.cpu.get_cpu_capability()), fp32_ms=round(fp32_ms, 3),
                     bf16_ms=round(bf16_ms, 3), cpu=_cpuinfo()[0], key=key,
                     measured=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    _write_cache(key, {k: v for k, v in asdict(p).items() if k != "source"})
    return p


def cached_precision() -> CpuPrecision | None:
    """The cached decision for this machine, or None (nothing measured yet); never measures, never imports torch."""
    rec = _read_cache().get(machine_key())
    if not isinstance(rec, dict):
        return None
    try:
        return CpuPrecision(**{f: rec[f] for f in CpuPrecision.__dataclass_fields__ if f != "source"}, source="cache")
    except (KeyError, TypeError):
        return None


def resolve_precision(requested: str, device_type: str, precision: CpuPrecision | None = None) -> str:
    """`bfloat16` | `float32` for a requested `auto` | `bfloat16` | `float32` on `device_type` (cpu | cuda):
    explicit values stay; auto is bfloat16 on CUDA, and on a CPU where `cpu_precision()` says bf16 is fast."""
    if requested not in PRECISION_CHOICES:
        raise ValueError(f"precision must be one of {PRECISION_CHOICES}, not {requested!r}")
    if requested != "auto":
        return requested
    if device_type == "cuda":
        return "bfloat16"
    return "bfloat16" if (precision or cpu_precision()).bf16_fast else "float32"


def slow_bf16_warning(what: str, precision: CpuPrecision) -> str | None:
    """The warning for an explicit bf16 on a CPU where it is not fast (None where it is)."""
    if precision.bf16_fast:
        return None
    return (f"{what}: bfloat16 on a CPU without fast bf16 GEMMs: measured {precision.bf16_over_fp32:.1f}x fp32's time "
            f"here ({precision.describe()}); set it to auto (float32 on this CPU, bfloat16 where bf16 is native) "
            "or float32")
