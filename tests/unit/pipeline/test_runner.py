"""Fingerprints, skip/rerun reasons, atomic commit, crash recovery and the workdir lock."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pipeline import registry, runner
from pipeline.config import load_config
from pipeline.errors import LockedError, UsageError
from pipeline.store import MANIFEST, Store

from conftest import REPO, TINY_CONFIG, run_cli, tiny_overrides


def _cfg(*overrides: str):
    ov = [o for o in tiny_overrides("target", "data")[1::2]] + list(overrides)
    return load_config(TINY_CONFIG, ov)


def _fps(cfg, store) -> dict[str, str]:
    return {p.name: p.fingerprint for p in runner.make_plan(cfg, store)}


def test_fingerprints_are_deterministic_and_scoped(tmp_path):
    store = Store(tmp_path)
    a, b = _fps(_cfg(), store), _fps(_cfg(), store)
    assert a == b
    c = _fps(_cfg("data.max_samples=99"), store)
    assert c["target"] == a["target"]
    assert c["data"] != a["data"]
    # everything downstream of data changes too
    for spec in registry.stages():
        if spec.name not in ("target", "data"):
            assert c[spec.name] != a[spec.name], spec.name
    # run settings never enter a fingerprint
    assert _fps(_cfg("run.threads=1", "run.log_level=debug"), store) == a
    # nor does switching a stage off and on
    assert _fps(_cfg("target.enabled=true"), store) == a


def _fake_commit(store: Store, cfg, name: str) -> None:
    """Commit an artifact for `name` exactly as the runner would record it (without running the stage)."""
    item = next(p for p in runner.make_plan(cfg, store) if p.name == name)
    tmp = store.new_tmp(name)
    (tmp / "x.txt").write_text(name)
    store.commit(name, tmp, {"stage": name, "fingerprint": item.fingerprint, "fingerprint_inputs": item.doc,
                             "metrics": {}, "provenance": {}})


def test_plan_reasons(tmp_path):
    store = Store(tmp_path)
    cfg = _cfg()
    plan = {p.name: p for p in runner.make_plan(cfg, store)}
    assert plan["target"].action == "run" and plan["target"].reason == "no artifact"
    _fake_commit(store, cfg, "target")
    _fake_commit(store, cfg, "data")
    plan = {p.name: p for p in runner.make_plan(cfg, store)}
    assert plan["target"].action == "skip" and plan["data"].action == "skip"

    plan = {p.name: p for p in runner.make_plan(_cfg("data.max_samples=7"), store)}
    assert plan["target"].action == "skip"
    assert plan["data"].reason == "params changed: data.max_samples"

    plan = {p.name: p for p in runner.make_plan(_cfg("target.tiny.steps=41"), store)}
    assert plan["target"].reason == "params changed: target.tiny.steps"
    assert plan["data"].reason == "input changed: target"

    plan = {p.name: p for p in runner.make_plan(cfg, store, force=("data",))}
    assert plan["data"].action == "run" and plan["data"].reason == "forced"
    assert plan["target"].action == "skip"
    plan = {p.name: p for p in runner.make_plan(cfg, store, force=("all",))}
    assert plan["target"].reason == "forced"

    # a manifest whose code hash differs says so
    m = json.loads((store.artifacts / "data" / MANIFEST).read_text())
    m["fingerprint"] = "0" * 64
    m["fingerprint_inputs"]["code"] = "old"
    (store.artifacts / "data" / MANIFEST).write_text(json.dumps(m))
    plan = {p.name: p for p in runner.make_plan(cfg, store)}
    assert plan["data"].reason == "code changed"

    # per-file digests (pipeline/codehash.py): the reason names the runtime file that changed, not only the stage module
    m["fingerprint_inputs"]["code"] = {**registry.get("data").code, "runtime/data/rows.py": "0" * 16}
    (store.artifacts / "data" / MANIFEST).write_text(json.dumps(m))
    plan = {p.name: p for p in runner.make_plan(cfg, store)}
    assert plan["data"].action == "run" and plan["data"].reason == "code changed: runtime/data/rows.py"

    with pytest.raises(UsageError, match="unknown stage"):
        runner.make_plan(cfg, store, only="nope")


def test_package_versions_read_from_the_header_are_importlib_metadatas():
    from importlib import metadata

    names = {p for s in registry.stages() for p in s.packages} | {"pydantic", "click", "no-such-package-xyz"}
    for name in sorted(names):
        try:
            want = metadata.version(name)
        except metadata.PackageNotFoundError:
            want = None
        assert runner.package_version(name) == want, name
    assert runner.package_version("pydantic") is not None and runner.package_version("no-such-package-xyz") is None


NOOP_BUILD = """
import json, sys
from pipeline.cli import cli
code = None
try:
    cli.main(sys.argv[1:], prog_name="specpipe")
except SystemExit as e:
    code = e.code
heavy = ("torch", "transformers", "datasets", "modelopt", "numpy", "matplotlib")
print(json.dumps({"code": code, "heavy": [m for m in heavy if m in sys.modules]}))
"""


def test_a_noop_build_imports_no_heavy_library(tmp_path):
    """Structural, not timed (the no-op rebuild budget, docs/benchmarks.md): a build with every stage up to date loads
    the config, plans and prints the table without importing torch, transformers, numpy (stages import them in
    `run`), and a plan that has a stage to run still reads the same way."""
    store = Store(tmp_path / "w")
    cfg = _cfg()
    for name in registry.names():
        _fake_commit(store, cfg, name)
    ov = [a for o in tiny_overrides("target", "data")[1::2] for a in ("-o", o)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    for cmd, skipped in (("build", len(registry.names())), ("plan", None)):
        r = subprocess.run([sys.executable, "-c", NOOP_BUILD, cmd, str(TINY_CONFIG), "--workdir", str(store.root), *ov],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out == {"code": 0, "heavy": []}, (out, r.stderr[-2000:])
        if skipped:
            assert r.stderr.count("skip: up to date") == skipped, r.stderr[-2000:]
    # the check can fail: the same probe sees torch once something imports it
    r = subprocess.run([sys.executable, "-c", "import torch\n" + NOOP_BUILD, "--version"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert "torch" in json.loads(r.stdout.strip().splitlines()[-1])["heavy"]


def test_only_requires_up_to_date_inputs(tmp_path):
    store = Store(tmp_path)
    cfg = _cfg()
    with pytest.raises(UsageError, match="needs 'target' up to date"):
        runner.make_plan(cfg, store, only="data")
    _fake_commit(store, cfg, "target")
    plan = {p.name: p for p in runner.make_plan(cfg, store, only="data")}
    assert plan["data"].action == "run" and plan["target"].action == "excluded"


def test_commit_is_atomic_and_replaces(tmp_path):
    store = Store(tmp_path)
    tmp = store.new_tmp("s")
    (tmp / "a.bin").write_bytes(b"1")
    (tmp / "sub").mkdir()
    (tmp / "sub" / "b.txt").write_text("2")
    art = store.commit("s", tmp, {"stage": "s", "fingerprint": "f1"})
    assert not tmp.exists()
    assert set(art.manifest["files"]) == {"a.bin", "sub/b.txt"}
    assert store.manifest("s")["fingerprint"] == "f1"
    assert store.verify("s") == []
    (store.artifacts / "s" / "a.bin").write_bytes(b"tampered")
    assert store.verify("s") == ["a.bin: changed"]
    tmp2 = store.new_tmp("s")
    (tmp2 / "c.txt").write_text("3")
    store.commit("s", tmp2, {"stage": "s", "fingerprint": "f2"})
    assert sorted(p.name for p in (store.artifacts / "s").iterdir()) == ["c.txt", MANIFEST]
    # a directory without a manifest (a crash between rename and manifest) is never trusted
    (store.artifacts / "s" / MANIFEST).unlink()
    assert store.manifest("s") is None and store.artifact("s") is None


def test_lock_refuses_a_second_build(tmp_path):
    wd = tmp_path / "w"
    holder = Store(wd)
    holder.lock()
    try:
        with pytest.raises(LockedError):
            Store(wd).lock()
        r = run_cli("build", str(TINY_CONFIG), "--workdir", str(wd), *tiny_overrides())
        assert r.returncode == 1
        assert "in use by another specpipe process" in r.stderr and str(os.getpid()) in r.stderr
        assert not (wd / "artifacts").exists()
    finally:
        holder.unlock()


def test_execution_only_fields_stay_out_of_fingerprints(tmp_path):
    store = Store(tmp_path)
    def launcher(**kw):
        return "train_draft.launcher={" + ", ".join(f"{k}: {v}" for k, v in {"kind": "torchrun", **kw}.items()) + "}"

    base = _fps(_cfg(launcher(nnodes=2, rdzv_endpoint="node0:29500")), store)
    moved = _fps(_cfg(launcher(nnodes=2, rdzv_endpoint="node7:29400", timeout_s=60, node_rank=1)), store)
    assert moved["train_draft"] == base["train_draft"]
    more = _fps(_cfg(launcher(nnodes=4, rdzv_endpoint="node0:29500")), store)
    assert more["train_draft"] != base["train_draft"]   # the process count changes the result
