"""`auto` precision by the machine (runtime/engine/precision.py): bf16 only where the CPU runs it natively and
measurably faster, decided once per machine and cached; explicit bf16 where it is slow: a warning with the measured
slowdown; vLLM on such a CPU asked for float32."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import subprocess
import sys

import pytest

from runtime.engine import precision as P

from conftest import REPO

X86 = platform.machine().lower() in ("x86_64", "amd64")
# oneDNN and ATen capped at AVX2: bf16 GEMMs emulated, as on a CPU without AVX512-BF16/AMX (docs/benchmarks.md)
AVX2_ONLY = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPIPE_CACHE_DIR", str(tmp_path))
    return tmp_path / "precision.json"


def decided(fast: bool) -> P.CpuPrecision:
    """A recorded decision for this machine (what a cache entry holds), bf16 fast or not."""
    return P.CpuPrecision(bf16_fast=fast, native_bf16=fast, capability="AVX512" if fast else "AVX2",
                          fp32_ms=40.0, bf16_ms=16.0 if fast else 300.0, cpu="test CPU", key=P.machine_key(),
                          measured="2026-12-07T00:00:00Z")


def store(cache, p: P.CpuPrecision) -> None:
    cache.parent.mkdir(parents=True, exist_ok=True)
    rec = {k: v for k, v in dataclasses.asdict(p).items() if k != "source"}
    cache.write_text(json.dumps({P.machine_key(): rec}))


def test_measured_once_then_read_from_the_cache_and_consistent(cache):
    first = P.cpu_precision()
    assert first.source == "measured" and first.fp32_ms > 0 and first.bf16_ms > 0
    # auto never picks the slower dtype: bf16 only where native AND measured faster by the margin
    assert first.bf16_fast == (first.native_bf16 and first.bf16_ms <= P.MARGIN * first.fp32_ms)
    assert json.loads(cache.read_text())[P.machine_key()]["bf16_fast"] == first.bf16_fast
    again = P.cpu_precision()
    assert again.source == "cache" and dataclasses.replace(again, source="measured") == first
    assert P.cached_precision() == again


def test_the_cache_key_follows_what_decides_it(cache, monkeypatch):
    key = P.machine_key()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert P.machine_key() != key           # an ISA cap in the environment is another machine
    store(cache, decided(True))
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    assert P.cached_precision() is None     # nothing recorded under this machine's key


@pytest.mark.skipif(not X86, reason="the ISA caps are x86 oneDNN/ATen settings")
def test_a_cpu_without_native_bf16_resolves_auto_to_float32(tmp_path):
    """On a CPU whose bf16 GEMMs are emulated (here: capped at AVX2) `auto` is float32 and bf16 measures slower."""
    code = ("import json; from runtime.engine.precision import cpu_precision, resolve_precision; p = cpu_precision(); "
            "print(json.dumps([p.native_bf16, p.bf16_fast, p.bf16_ms / p.fp32_ms, resolve_precision('auto', 'cpu', p)]))")
    env = {**os.environ, **AVX2_ONLY, "SPECPIPE_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr
    native, fast, ratio, auto = json.loads(r.stdout.strip().splitlines()[-1])
    assert (native, fast, auto) == (False, False, "float32")
    assert ratio > 1.5, f"bf16 emulated measured only {ratio:.2f}x fp32's time"


def test_resolution_rules(cache):
    assert P.resolve_precision("float32", "cpu", decided(True)) == "float32"
    assert P.resolve_precision("bfloat16", "cpu", decided(False)) == "bfloat16"     # explicit stays (with a warning)
    assert P.resolve_precision("auto", "cpu", decided(True)) == "bfloat16"
    assert P.resolve_precision("auto", "cpu", decided(False)) == "float32"
    assert P.resolve_precision("auto", "cuda", decided(False)) == "bfloat16"       # a GPU keeps bf16
    with pytest.raises(ValueError):
        P.resolve_precision("fp16", "cpu", decided(True))
    assert P.slow_bf16_warning("x", decided(True)) is None
    msg = P.slow_bf16_warning("train_draft.target_dtype", decided(False))
    assert "7.5x fp32's time" in msg and "auto" in msg


def test_runtime_compute_auto_and_the_explicit_bf16_warning(cache, caplog):
    from runtime.engine.compute import native_bf16_gemm, resolve_compute

    store(cache, decided(False))
    with caplog.at_level(logging.WARNING, logger="specpipe"):
        assert resolve_compute("bf16") == "bf16"
    assert "7.5x fp32's time" in caplog.text and "compute auto" in caplog.text
    assert resolve_compute("auto") == "fp32"          # not fast here: whatever the capability check says
    store(cache, decided(True))
    assert resolve_compute("auto") == ("bf16" if native_bf16_gemm() else "fp32")


def test_the_benches_time_bf16_where_the_stages_take_it(cache):
    """bench/real_model/bench_steps.py and bench_e2e.py time the modes `default_modes` gives: bf16 only where the
    measured decision takes it (a CPU whose capability check says native bf16 but whose bf16 measured slower: fp32
    alone), or where forced."""
    from runtime.engine.compute import default_modes, native_bf16_gemm

    store(cache, decided(False))
    assert default_modes() == ["fp32"] and default_modes(force_bf16=True) == ["fp32", "bf16"]
    store(cache, decided(True))
    assert default_modes() == (["fp32", "bf16"] if native_bf16_gemm() else ["fp32"])


def test_vllm_on_a_slow_bf16_cpu_is_asked_for_float32(cache, tmp_path):
    from runtime.vllm.engine import ServeArgs, VllmInstall, VllmServer

    def argv(device: str, **kw) -> list[str]:
        srv = VllmServer(VllmInstall("python", "0.32.0", device), ServeArgs("m", **kw), log_path=tmp_path / "v.log")
        return srv.argv

    store(cache, decided(False))
    a = argv("cpu")
    assert a[a.index("--dtype") + 1] == "float32"
    assert argv("cpu", dtype="bfloat16")[-1] == "bfloat16"     # an explicit dtype is passed as given
    assert "--dtype" not in argv("cuda")
    store(cache, decided(True))
    assert "--dtype" not in argv("cpu")                          # vLLM's own choice: the checkpoint's bf16


@pytest.mark.skipif(not X86, reason="the ISA caps are x86 oneDNN/ATen settings")
def test_the_measurement_overrules_the_capability_check(tmp_path):
    """oneDNN capped at AVX512_CORE on a CPU with AVX512-BF16: the capability check still says native bf16 (the CPU's
    flags), but bf16 GEMMs are emulated and slower; `auto` follows the measurement (float32). Compute mode auto too."""
    code = ("import json; from runtime.engine.precision import cpu_precision; from runtime.engine.compute import "
            "resolve_compute; p = cpu_precision(); "
            "print(json.dumps([p.native_bf16, p.bf16_fast, p.bf16_ms / p.fp32_ms, resolve_compute('auto')]))")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "SPECPIPE_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr
    native, fast, ratio, compute = json.loads(r.stdout.strip().splitlines()[-1])
    if not native:
        pytest.skip("this CPU has no native bf16: the case needs one (AVX512-BF16 or AMX)")
    assert ratio > 1.0 and (fast, compute) == (False, "fp32"), (ratio, fast, compute)
