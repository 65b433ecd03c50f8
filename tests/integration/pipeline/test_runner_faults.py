"""The runner under faults, through real `specpipe build`s of the tiny pipeline's first stages (tests/integration: minutes
of CPU, `slow`): a crash at each commit point then a resume, SIGKILL mid-training resuming from its checkpoint,
SIGTERM unwinding like Ctrl-C. The runner's other tests: test_runner.py."""
from __future__ import annotations

import json
import signal

import pytest

from pipeline import registry
from pipeline.store import MANIFEST

from conftest import TINY_CONFIG, run_cli, status_json, tiny_overrides

pytestmark = pytest.mark.slow


def _reference_fps(tmp_path) -> dict[str, str]:
    r = run_cli("plan", str(TINY_CONFIG), "--workdir", str(tmp_path / "ref"), "--json", *tiny_overrides())
    assert r.returncode == 0, r.stderr
    return {i["stage"]: i["fingerprint"] for i in json.loads(r.stdout)}


@pytest.mark.parametrize("fault", ["target:after-run", "target:after-rename", "data:after-run", "data:after-rename"])
def test_crash_at_commit_points_then_resume(tmp_path, fault):
    """SIGKILL at the riskiest points of a commit; the next build completes with the same fingerprints."""
    wd = tmp_path / "w"
    ov = tiny_overrides("target", "data")
    disable = []
    for name in registry.names():
        if name not in ("target", "data"):
            disable += ["-o", f"{name}.enabled=false"]
    r = run_cli("build", str(TINY_CONFIG), "--workdir", str(wd), *ov, *disable, env={"SPECPIPE_FAULT": fault})
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stderr[-2000:])
    stage = fault.split(":")[0]
    st = {s["name"]: s for s in status_json(wd)["stages"]}
    assert st[stage]["state"] != "committed"          # nothing half-written is trusted
    r = run_cli("build", str(TINY_CONFIG), "--workdir", str(wd), *ov, *disable)
    assert r.returncode == 0, r.stderr[-3000:]
    st = {s["name"]: s for s in status_json(wd)["stages"]}
    ref = _reference_fps(tmp_path)
    for name in ("target", "data"):
        assert st[name]["state"] == "committed"
        assert st[name]["fingerprint"] == ref[name]
    assert not any((wd / ".tmp").iterdir()) if (wd / ".tmp").exists() else True
    assert not list((wd / "artifacts").glob(".old-*"))


def test_sigkill_mid_training_resumes_from_checkpoint(tmp_path):
    """SIGKILL the real CLI right after the target's second pretraining checkpoint (fault injection,
    SPECPIPE_FAULT=target:pretrain-checkpoint-40): nothing is committed, and the next build resumes from exactly that
    checkpoint and ends with the fingerprints of an uninterrupted plan."""
    wd = tmp_path / "w"
    ov = tiny_overrides("target", "data") + ["-o", "target.tiny.steps=60", "-o", "target.tiny.checkpoint_every=20"]
    ov += [x for name in registry.names() if name not in ("target", "data") for x in ("-o", f"{name}.enabled=false")]
    r = run_cli("build", str(TINY_CONFIG), "--workdir", str(wd), *ov, env={"SPECPIPE_FAULT": "target:pretrain-checkpoint-40"})
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stderr[-2000:])
    assert list((wd / "scratch" / "target").glob("*/pretrain.pt"))
    assert not (wd / "artifacts" / "target" / MANIFEST).exists()
    r = run_cli("build", str(TINY_CONFIG), "--workdir", str(wd), *ov)
    assert r.returncode == 0, r.stderr[-3000:]
    log = (wd / "logs" / "target.log").read_text()
    assert "resuming pretraining from step 40" in log, log[-2000:]
    st = {s["name"]: s for s in status_json(wd)["stages"]}
    ref = run_cli("plan", str(TINY_CONFIG), "--workdir", str(tmp_path / "ref"), "--json", *ov)
    ref_fps = {i["stage"]: i["fingerprint"] for i in json.loads(ref.stdout)}
    assert st["target"]["fingerprint"] == ref_fps["target"]
    assert st["data"]["fingerprint"] == ref_fps["data"]
    assert not (wd / "scratch" / "target").exists()   # scratch is dropped once committed


def test_sigterm_mid_stage_unwinds_like_ctrl_c(tmp_path):
    """SIGTERM (Slurm's preemption and time limit send it) while the target pretrains, delivered by fault injection
    right after the first checkpoint (SPECPIPE_FAULT=target:pretrain-checkpoint-20:TERM): the build unwinds as on
    Ctrl-C (exit 130, the log says nothing was committed, no temporary directory left), where Python's default
    SIGTERM would end the process at once and leave the servers a stage started (own process groups) running."""
    wd = tmp_path / "w"
    ov = tiny_overrides("target") + ["-o", "target.tiny.steps=60", "-o", "target.tiny.checkpoint_every=20"]
    ov += [x for name in registry.names() if name != "target" for x in ("-o", f"{name}.enabled=false")]
    r = run_cli("build", str(TINY_CONFIG), "--workdir", str(wd), *ov,
                env={"SPECPIPE_FAULT": "target:pretrain-checkpoint-20:TERM"}, timeout=600)
    assert r.returncode == 130, (r.returncode, r.stderr[-2000:])
    assert "interrupted: nothing half-written was committed" in r.stderr
    log = (wd / "logs" / "target.log").read_text()
    assert "interrupted after" in log
    assert "pretrained 60 steps" not in log            # it stopped mid-pretraining, not after
    assert not (wd / "artifacts" / "target" / MANIFEST).exists()
    assert not any((wd / ".tmp").iterdir()) if (wd / ".tmp").exists() else True
