"""The real CLI on the tiny default: build, build again (everything skipped), change one field (exactly the
affected stages rerun), status --json, report."""
from __future__ import annotations

import json
import re
import shutil

from pipeline import registry

from conftest import TINY_CONFIG, run_cli, status_json, tiny_overrides


def _downstream(of: str) -> set[str]:
    out = {of}
    for spec in registry.stages():
        if set(spec.consumes) & out:
            out.add(spec.name)
    return out


def _actions(workdir) -> dict[str, str]:
    doc = json.loads((workdir / "last_build.json").read_text())
    return {k: v["action"] for k, v in doc["stages"].items()}


def test_build_skip_rerun_status_report(tiny_run, tmp_path):
    wd, first = tiny_run
    assert first.returncode == 0, first.stderr[-4000:]
    st = status_json(wd)
    assert [s["name"] for s in st["stages"]] == registry.names()
    for s in st["stages"]:
        assert s["state"] == "committed", s
        assert re.fullmatch(r"[0-9a-f]{64}", s["fingerprint"])
        assert s["wall_time_s"] > 0 and s["peak_rss_mb"] > 0
    target = next(s for s in st["stages"] if s["name"] == "target")
    tm = target["metrics"]
    assert tm["num_layers"] == 4 and tm["pretrain_final_loss"] < tm["pretrain_first_loss"]
    data = next(s for s in st["stages"] if s["name"] == "data")
    assert data["metrics"]["train_samples"] > 0 and set(data["metrics"]["eval_domains"]) == {"code", "prose"}

    # provenance travels with every artifact
    m = json.loads((wd / "artifacts" / "data" / "manifest.json").read_text())
    prov = m["provenance"]
    assert prov["command"].startswith("specpipe build") and prov["config"]["max_samples"] == 120
    assert prov["packages"]["transformers"] and prov["inputs"]["target"]["digest"]
    assert set(m["files"]) >= {"train.parquet", "calib.parquet", "heldout.parquet", "stats.json", "eval/code.jsonl"}

    # second build: every stage skipped, and said so
    again = run_cli("build", str(TINY_CONFIG), "--workdir", str(wd), *tiny_overrides())
    assert again.returncode == 0, again.stderr[-3000:]
    assert set(_actions(wd).values()) == {"skip"}
    for name in registry.names():
        assert f"[{name}] skip: up to date" in again.stderr

    # one field changed: exactly that stage and what consumes it (transitively) rerun. In a copy: the session's
    # tiny run is shared with later tests, which need it built from tiny_overrides() as it stands.
    wd = tmp_path / "run"
    shutil.copytree(tiny_run[0], wd, symlinks=True)
    changed = run_cli("build", str(TINY_CONFIG), "--workdir", str(wd), *tiny_overrides(), "-o", "data.eval_prompts=3")
    assert changed.returncode == 0, changed.stderr[-3000:]
    acts = _actions(wd)
    reran = {k for k, v in acts.items() if v == "ran"}
    assert reran == _downstream("data"), acts
    assert "[data] run: params changed: data.eval_prompts" in changed.stderr
    assert "[target] skip: up to date" in changed.stderr

    # report: self-contained HTML with the stage table
    r = run_cli("report", "--workdir", str(wd))
    assert r.returncode == 0, r.stderr
    html = (wd / "report.html").read_text()
    assert "<table>" in html and all(f"<h2>{n}</h2>" in html for n in registry.names())
    assert "src=\"http" not in html   # nothing loaded from elsewhere
