"""The resolved dtype enters a stage's fingerprint exactly where it changes what is committed: train_draft with an
`auto` target dtype retrains where this machine resolves it otherwise; the stages before it (whose artifacts do not
depend on it) and a train_draft with explicit dtypes keep their fingerprints on every machine."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

from pipeline import plan, runner
from pipeline.config import load_config
from pipeline.store import Store
from runtime.engine import precision as P

from conftest import REPO, TINY_CONFIG, tiny_overrides


def _store_decision(cache_dir, fast: bool) -> None:
    p = P.CpuPrecision(bf16_fast=fast, native_bf16=fast, capability="AVX512" if fast else "AVX2", fp32_ms=40.0,
                       bf16_ms=16.0 if fast else 300.0, cpu="test CPU", key=P.machine_key(), measured="2026-12-07T00:00:00Z")
    (cache_dir / "precision.json").write_text(json.dumps({P.machine_key(): {
        k: v for k, v in dataclasses.asdict(p).items() if k != "source"}}))


def _plan(tmp_path, *overrides: str) -> dict:
    cfg = load_config(TINY_CONFIG, tiny_overrides()[1::2] + ["run.device=cpu", *overrides])
    return {p.name: p for p in runner.make_plan(cfg, Store(tmp_path / "run"))}


def test_auto_resolving_otherwise_changes_train_draft_and_nothing_before_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPIPE_CACHE_DIR", str(tmp_path))
    _store_decision(tmp_path, fast=True)
    fast = _plan(tmp_path)           # the tiny configs leave target_dtype at auto
    _store_decision(tmp_path, fast=False)
    slow = _plan(tmp_path)
    assert fast["train_draft"].doc["resolved"] == {"train_dtype": "float32", "target_dtype": "bfloat16"}
    assert slow["train_draft"].doc["resolved"] == {"train_dtype": "float32", "target_dtype": "float32"}
    assert fast["train_draft"].fingerprint != slow["train_draft"].fingerprint
    for name in ("target", "data"):          # their artifacts do not depend on the training precision
        assert fast[name].fingerprint == slow[name].fingerprint and "resolved" not in fast[name].doc
    # quantize calibrates in float32 on any CPU: its own resolution is the same, only its train_draft input moved
    assert fast["quantize"].doc["resolved"] == slow["quantize"].doc["resolved"] == {"calib_dtype": "float32"}
    assert {k: v for k, v in fast["quantize"].doc.items() if k != "inputs"} == \
        {k: v for k, v in slow["quantize"].doc.items() if k != "inputs"}
    reason = runner.stale_reason(fast["train_draft"].doc, slow["train_draft"].doc)
    assert reason == "resolved on this machine differently: train_draft.target_dtype bfloat16 -> float32"


def test_explicit_dtypes_fingerprint_the_same_on_every_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPIPE_CACHE_DIR", str(tmp_path))
    fps = []
    for fast in (True, False):
        _store_decision(tmp_path, fast)
        plan = _plan(tmp_path, "train_draft.target_dtype=float32")
        assert plan["train_draft"].doc["resolved"] == {"train_dtype": "float32", "target_dtype": "float32"}
        fps.append({n: p.fingerprint for n, p in plan.items()})
    assert fps[0] == fps[1]


def test_a_plan_reads_the_cached_decision_without_importing_torch(tmp_path):
    """The no-op rebuild's plan must not import torch (~0.3 s): with the decision cached it reads only the file."""
    _store_decision(tmp_path, fast=True)
    code = ("import sys; from pipeline import runner; from pipeline.config import load_config; "
            "from pipeline.store import Store; "
            f"cfg = load_config({str(TINY_CONFIG)!r}, ['train_draft.target_dtype=auto', 'run.device=cpu']); "
            f"p = runner.make_plan(cfg, Store({str(tmp_path / 'run')!r})); "
            "print([i.doc['resolved'] for i in p if i.name == 'train_draft'][0]['target_dtype'], 'torch' in sys.modules)")
    env = {**os.environ, "SPECPIPE_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["bfloat16", "False"]


def test_the_device_decides_quantize_calibration_and_training_dtype(tmp_path, monkeypatch):
    """On CUDA training runs in bf16 and quantize calibrates in bf16: both fingerprints differ from a CPU's."""
    monkeypatch.setenv("SPECPIPE_CACHE_DIR", str(tmp_path))
    _store_decision(tmp_path, fast=False)
    cpu = _plan(tmp_path)
    assert cpu["train_draft"].doc["resolved"] == {"train_dtype": "float32", "target_dtype": "float32"}
    monkeypatch.setattr(plan, "plan_device_type", lambda run_cfg: "cuda")     # what pipeline/plan.py fingerprints with
    gpu = _plan(tmp_path)
    assert gpu["train_draft"].doc["resolved"] == {"train_dtype": "bfloat16", "target_dtype": "bfloat16"}
    assert gpu["quantize"].doc["resolved"] == {"calib_dtype": "bfloat16"}
    assert gpu["data"].fingerprint == cpu["data"].fingerprint
    assert gpu["train_draft"].fingerprint != cpu["train_draft"].fingerprint
