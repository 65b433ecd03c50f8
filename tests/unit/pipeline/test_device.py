"""`run.device` is resolved once, by the runner (pipeline/device.py), and the stages take it from `ctx.device`."""
from __future__ import annotations

import ast
import json
from types import SimpleNamespace

import pytest
import torch

from pipeline import registry, runner
from pipeline.config import load_config
from pipeline.device import ResolvedDevice, resolve_device
from pipeline.errors import ConfigError
from pipeline.store import Store

from conftest import REPO, TINY, TINY_CONFIG, run_cli, tiny_overrides

HERE = "cuda" if torch.cuda.is_available() else "cpu"


def test_resolve_device_values():
    assert resolve_device(SimpleNamespace(device="cpu")) == ResolvedDevice("cpu", "cpu")
    assert resolve_device(SimpleNamespace(device="auto")) == ResolvedDevice("auto", HERE)
    assert resolve_device(SimpleNamespace(device="auto")).torch == torch.device(HERE)
    with pytest.raises(ConfigError) as e:
        resolve_device(SimpleNamespace(device="tpu"))
    assert e.value.problems[0][0] == "run.device" and "auto, cpu, cuda" in e.value.problems[0][1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA device")
def test_cuda_without_a_gpu_fails_before_any_stage(tmp_path):
    with pytest.raises(ConfigError) as e:
        resolve_device(SimpleNamespace(device="cuda"))
    assert e.value.problems[0][0] == "run.device"
    wd = tmp_path / "run"
    r = run_cli("build", str(TINY_CONFIG), "--workdir", str(wd), *tiny_overrides(), "-o", "run.device=cuda")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "run.device: cuda, but torch sees no CUDA device" in r.stderr
    assert not (wd / "logs").exists() and not (wd / "artifacts").exists()   # no stage started


def test_runner_resolves_once_and_every_stage_receives_it(tmp_path, monkeypatch):
    """The runner resolves `run.device` once per build, before the first stage, hands the same value to every
    stage it runs and records it in their provenance; a build with nothing to run does not resolve it."""
    calls, seen = [], {}

    def counting(run_cfg):
        calls.append(run_cfg.device)
        return resolve_device(run_cfg)

    def recorder(ctx):   # each stage body replaced: what the runner hands a stage is what is under test
        seen[ctx.name] = ctx.device
        (ctx.out_dir / "device.txt").write_text(ctx.device.type)
        return {}

    monkeypatch.setattr(runner, "resolve_device", counting)
    for spec in registry.stages():
        monkeypatch.setattr(spec.module, "run", recorder)
    cfg = load_config(TINY_CONFIG, [o for items in TINY.values() for o in items])
    store = Store(tmp_path / "run")
    outcomes = runner.build(cfg, store, argv=["specpipe", "build"], config_path=str(TINY_CONFIG))
    ran = [o.name for o in outcomes if o.action == "ran"]
    assert ran and ran == list(seen) and calls == ["auto"]
    assert {id(d) for d in seen.values()} == {id(seen[ran[0]])}
    assert seen[ran[0]] == ResolvedDevice("auto", HERE)
    for name in ran:
        art = store.root / "artifacts" / name
        assert (art / "device.txt").read_text() == HERE
        assert json.loads((art / "manifest.json").read_text())["provenance"]["device"] == HERE
    again = runner.build(cfg, store, argv=["specpipe", "build"], config_path=str(TINY_CONFIG))
    assert {o.action for o in again} <= {"skip", "disabled"} and calls == ["auto"]


def _reads_run_device(node: ast.AST) -> bool:
    """`<x>.run.device`, or getattr(<...>, "device") on the run section."""
    if isinstance(node, ast.Attribute) and node.attr == "device":
        v = node.value
        return (isinstance(v, ast.Attribute) and v.attr == "run") or \
            (isinstance(v, ast.Call) and ast.unparse(v).startswith("getattr(") and "'run'" in ast.unparse(v))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" and len(node.args) > 1:
        a, b = node.args[0], node.args[1]
        return isinstance(b, ast.Constant) and b.value == "device" and "run" in ast.unparse(a)
    return False


def test_nothing_but_pipeline_device_reads_run_device():
    readers = []
    for pkg in ("pipeline", "stages", "runtime"):
        for f in sorted((REPO / pkg).rglob("*.py")):
            if f == REPO / "pipeline" / "device.py":
                continue
            tree = ast.parse(f.read_text())
            readers += [f"{f.relative_to(REPO)}:{n.lineno}" for n in ast.walk(tree) if _reads_run_device(n)]
    assert readers == [], f"run.device is resolved in pipeline/device.py only; read ctx.device instead: {readers}"
    assert _reads_run_device(ast.parse("ctx.config.run.device").body[0].value)      # the check can fail
    assert _reads_run_device(ast.parse("getattr(getattr(c, 'run', None), 'device', 'auto')").body[0].value)

