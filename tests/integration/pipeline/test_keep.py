"""A code change on a real tiny run, through the CLI: `plan` names the file and the import chain, an edit of the
vLLM export code leaves the early stages up to date, and `build --keep` keeps a committed artifact across a code
change, says so (status, report) and is refused where more than code changed (pipeline/keep.py).

The code is edited in a copy of the tree (pipeline/, stages/, runtime/, configs/) run with PYTHONPATH set to it,
and the run in a copy of the session's tiny workdir: the checkout and the shared run stay as they are."""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from conftest import REPO, run_cli, tiny_overrides

CODE = ("pipeline", "stages", "runtime", "configs")


@pytest.fixture
def copies(run_dir, tmp_path) -> tuple[Path, Path]:
    """(a copy of the code, a copy of the tiny run's workdir (conftest.run_dir), every stage committed)."""
    wd = run_dir
    code = tmp_path / "code"
    for d in CODE:
        shutil.copytree(REPO / d, code / d, ignore=shutil.ignore_patterns("__pycache__"))
    work = tmp_path / "run"
    shutil.copytree(wd, work, ignore=shutil.ignore_patterns(".lock", "scratch", "report.html"))
    return code, work


def _cli(code: Path, work: Path, *args: str):
    env = {"PYTHONPATH": os.pathsep.join([str(code), os.environ.get("PYTHONPATH", "")])}
    return run_cli(*args[:1], str(code / "configs" / "tiny_fp8_eagle3.yaml"), "--workdir", str(work), *tiny_overrides(),
                   *args[1:], cwd=code, env=env, timeout=900)


def _plan(code: Path, work: Path, *args: str) -> dict[str, dict]:
    r = _cli(code, work, "plan", "--json", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    return {i["stage"]: i for i in json.loads(r.stdout)}


def _edit(code: Path, rel: str, line: str) -> None:
    with open(code / rel, "a") as fh:
        fh.write(line)


def test_an_edit_of_the_vllm_export_reruns_only_the_stages_that_read_it(copies):
    """main 17f2668: a comment appended to runtime/vllm/speculators_format.py reran data and every stage after it.
    Now a comment reruns nothing, and a code edit reruns validate (and what reads it), naming the file and chain."""
    code, work = copies
    assert {s: i["action"] for s, i in _plan(code, work).items()} == dict.fromkeys(_plan(code, work), "skip")
    _edit(code, "runtime/vllm/speculators_format.py", "\n# a comment: no code\n")
    assert {i["action"] for i in _plan(code, work).values()} == {"skip"}
    _edit(code, "runtime/vllm/speculators_format.py", "\n_TOUCHED = 1\n")
    plan = _plan(code, work)
    assert {s for s, i in plan.items() if i["action"] == "run"} == {"validate", "tune", "build", "export"}
    for s in ("target", "data", "train_draft", "quantize"):
        assert plan[s]["action"] == "skip", plan[s]
    (ch,) = [c for c in plan["validate"]["code_changes"] if c["file"] == "runtime/vllm/speculators_format.py"]
    assert ch["via"][0] == "stages/validate.py" and ch["via"][-1] == "runtime/vllm/speculators_format.py"
    assert "code changed: runtime/vllm/speculators_format.py" in plan["validate"]["reason"]
    text = _cli(code, work, "plan").stdout
    assert re.search(r"runtime/vllm/speculators_format\.py: stages/validate\.py -> .* -> runtime/vllm/speculators_format\.py",
                     text), text


def test_a_kept_artifact_survives_a_code_change_and_says_so(copies):
    code, work = copies
    _edit(code, "runtime/training/export.py", "\n_TOUCHED = 1\n")          # in train_draft's closure only
    plan = _plan(code, work)
    assert plan["train_draft"]["action"] == "run" and plan["quantize"]["reason"].startswith("input changed: train_draft")
    # --from past it: refused, naming --keep
    r = _cli(code, work, "build", "--from", "quantize")
    assert r.returncode == 2 and "needs 'train_draft' up to date" in r.stderr and "--keep train_draft" in r.stderr, r.stderr
    # refused where more than code differs (exit 2, nothing written)
    r = _cli(code, work, "build", "--keep", "train_draft", "-o", "train_draft.steps=31")
    assert r.returncode == 2 and "more than its code changed (params changed: train_draft.steps" in r.stderr, r.stderr
    assert _plan(code, work, "--keep", "train_draft")["train_draft"]["action"] == "keep"
    r = _cli(code, work, "build", "--keep", "train_draft")
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"train_draft\s+│ kept", r.stderr), r.stderr
    assert all(i["action"] == "skip" for i in _plan(code, work).values())   # downstream: not rerun, now or later
    st = {s["name"]: s for s in json.loads(run_cli("status", "--workdir", str(work), "--json").stdout)["stages"]}
    (k,) = st["train_draft"]["kept"]
    assert k["code_changed"] == ["runtime/training/export.py"] and "--keep train_draft" in k["command"] and "@" in k["by"]
    assert all(not st[s]["kept"] for s in st if s != "train_draft")
    assert "train_draft: kept across a code change" in run_cli("status", "--workdir", str(work)).stdout
    assert run_cli("report", "--workdir", str(work)).returncode == 0
    assert "kept across a code change" in (work / "report.html").read_text()
    # a second edit: stale again, explained against the code it was kept under
    _edit(code, "runtime/training/export.py", "\n_TOUCHED_AGAIN = 2\n")
    assert _plan(code, work)["train_draft"]["reason"] == "code changed: runtime/training/export.py"


def test_keep_is_refused_where_the_format_changed_or_the_reader_rejects_it(copies):
    code, work = copies
    _edit(code, "runtime/cost/tuning.py", "\n_TOUCHED = 1\n")
    (work / "artifacts" / "tune" / "tuning.json").write_text("{}")             # the committed file breaks its contract
    r = _cli(code, work, "plan", "--keep", "tune")
    assert r.returncode == 2 and "--keep tune: the committed artifact does not read as its contract says" in r.stderr, r.stderr
    f = code / "stages" / "quantize.py"
    f.write_text(re.sub(r'^VERSION = "([^"]*)"', r'VERSION = "\1-next"', f.read_text(), count=1, flags=re.M))
    r = _cli(code, work, "plan", "--keep", "quantize")
    assert r.returncode == 2 and "--keep quantize: its artifact format changed (VERSION" in r.stderr, r.stderr
    r = _cli(code, work, "plan", "--keep", "nosuch")
    assert r.returncode == 2 and "--keep nosuch: unknown stage" in r.stderr
