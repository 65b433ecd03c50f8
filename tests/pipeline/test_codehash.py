"""A stage's fingerprint covers the runtime code it runs (pipeline/codehash.py): an edit of a runtime module a stage
reaches re-runs that stage, an edit of one it does not reach leaves it current."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from pipeline import codehash, registry

from support import REPO

pytestmark = pytest.mark.fast



def _tree(root: Path) -> Path:
    files = {
        "stages/s.py": "import json\n\ndef run(ctx):\n    from runtime.a import f  # heavy imports live in functions\n"
                       "    from pipeline.artifacts.x import read\n    from pipeline.report import table\n"
                       "    return f(read())\n",
        "runtime/__init__.py": "",
        "runtime/a.py": "from . import b\n\ndef f(x):\n    return b.g(x)\n",
        "runtime/b.py": "from .sub.deep import h\n\ndef g(x):\n    return h(x)\n",
        "runtime/sub/__init__.py": "",
        "runtime/sub/deep.py": "def h(x):\n    return x\n",
        "runtime/c.py": "def unused():\n    return 0\n",
        "pipeline/__init__.py": "",
        "pipeline/artifacts/__init__.py": "",
        "pipeline/artifacts/x.py": "def read():\n    return 1\n",
        "pipeline/report.py": "def table():\n    return ''\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root / "stages/s.py"


def test_closure_follows_function_level_relative_and_package_imports(tmp_path):
    stage = _tree(tmp_path)
    got = [str(p.relative_to(tmp_path)) for p in codehash.closure(stage, tmp_path)]
    assert got == ["stages/s.py", "pipeline/artifacts/__init__.py", "pipeline/artifacts/x.py", "runtime/__init__.py",
                   "runtime/a.py", "runtime/b.py", "runtime/sub/__init__.py", "runtime/sub/deep.py"]
    # not followed: the rest of pipeline/ (reports, logging, the runner) and modules nothing imports


def test_an_edit_of_reached_code_changes_the_digests_and_names_the_file(tmp_path):
    stage = _tree(tmp_path)
    before = codehash.code_digests(stage, tmp_path)
    (tmp_path / "runtime/c.py").write_text("def unused():\n    return 1\n")
    (tmp_path / "pipeline/report.py").write_text("def table():\n    return '<table>'\n")
    assert codehash.code_digests(stage, tmp_path) == before
    (tmp_path / "runtime/sub/deep.py").write_text("def h(x):\n    return -x\n")
    after = codehash.code_digests(stage, tmp_path)
    assert after != before and codehash.changed_files(before, after) == ["runtime/sub/deep.py"]
    assert codehash.changed_files("an old single hash", after) == []


def test_cached_imports_follow_every_edit_and_survive_a_broken_cache(tmp_path, monkeypatch):
    """The imports cache (one parse per file version, kept on disk for the next process) never answers for another
    version of a file: an import added after the file was cached is followed; a corrupt cache is only a slower parse."""
    monkeypatch.setenv("SPECPIPE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(codehash, "_CACHE", codehash._ImportCache())
    stage = _tree(tmp_path / "repo")
    root = tmp_path / "repo"
    first = codehash.closure(stage, root)
    cache_file = tmp_path / "cache" / "code-imports.json"
    cached = json.loads(cache_file.read_text())
    assert f"runtime/a.py:{hashlib.sha256((root / 'runtime/a.py').read_bytes()).hexdigest()}" in cached
    (root / "runtime/a.py").write_text("from . import b, c\n\ndef f(x):\n    return b.g(x) + c.unused()\n")
    assert root / "runtime/c.py" in codehash.closure(stage, root) and root / "runtime/c.py" not in first
    # a new process reads the cache from disk: same answers; a corrupt file is ignored and rewritten
    monkeypatch.setattr(codehash, "_CACHE", codehash._ImportCache())
    assert codehash.closure(stage, root) == codehash.closure(stage, root)
    cache_file.write_text("{not json")
    monkeypatch.setattr(codehash, "_CACHE", codehash._ImportCache())
    assert root / "runtime/c.py" in codehash.closure(stage, root)
    assert isinstance(json.loads(cache_file.read_text()), dict)


def test_a_full_imports_cache_drops_what_this_process_did_not_use(tmp_path, monkeypatch):
    """Every build reads the whole cache file, so it stays small: full, it keeps the entries this process used."""
    monkeypatch.setenv("SPECPIPE_CACHE_DIR", str(tmp_path / "cache"))
    cache_file = tmp_path / "cache" / "code-imports.json"
    cache_file.parent.mkdir()
    cache_file.write_text(json.dumps({f"other/m{i}.py:{i:064x}": ["runtime.c"] for i in range(10)}))
    monkeypatch.setattr(codehash._ImportCache, "MAX_ENTRIES", 12)
    monkeypatch.setattr(codehash, "_CACHE", codehash._ImportCache())
    root = tmp_path / "repo"
    stage = _tree(root)
    first = codehash.closure(stage, root)
    kept = json.loads(cache_file.read_text())
    assert sorted(k.split(":")[0] for k in kept) == sorted(str(p.relative_to(root)) for p in first)
    monkeypatch.setattr(codehash, "_CACHE", codehash._ImportCache())
    assert codehash.closure(stage, root) == first


def test_one_pass_reads_each_file_once_and_the_next_pass_sees_an_edit(tmp_path, monkeypatch):
    """registry.stages() shares one `Reads` over the stages' closures: the same digests as separate passes, each file
    read once; a pass after an edit (a new `Reads`) names the edited file, while the old pass's answers are stale."""
    stage = _tree(tmp_path)
    other = tmp_path / "stages/t.py"
    other.write_text("from runtime.b import g\n")
    opened: list[str] = []
    real_open = open

    def counting_open(f, mode):
        opened.append(f)
        return real_open(f, mode)

    monkeypatch.setattr(codehash, "open", counting_open, raising=False)
    reads = codehash.Reads()
    shared = [codehash.code_digests(s, tmp_path, reads=reads) for s in (stage, other)]
    assert len(opened) == len(set(opened)) == 9   # s.py, t.py, 5 under runtime/, 2 under pipeline/artifacts/
    assert shared == [codehash.code_digests(s, tmp_path) for s in (stage, other)]
    (tmp_path / "runtime/sub/deep.py").write_text("def h(x):\n    return -x\n")
    after = [codehash.code_digests(s, tmp_path, reads=codehash.Reads()) for s in (stage, other)]
    assert [codehash.changed_files(a, b) for a, b in zip(shared, after, strict=True)] == [["runtime/sub/deep.py"]] * 2
    assert codehash.code_digests(stage, tmp_path, reads=reads) == shared[0]   # why a Reads lives for one pass only


def test_each_stage_fingerprints_the_runtime_it_runs():
    code = {s.name: set(s.code) for s in registry.stages()}
    assert {"stages/quantize.py", "runtime/errors.py"} <= code["quantize"]
    assert any(f.startswith("runtime/quant/") for f in code["quantize"])
    assert any(f.startswith("runtime/training/") for f in code["train_draft"])
    assert any(f.startswith("runtime/engine/") for f in code["validate"])
    assert any(f.startswith("runtime/cost/") for f in code["tune"])
    assert not any(f.startswith(("runtime/quant/", "runtime/training/")) for f in code["target"])
    for name, files in code.items():
        assert all(f.startswith(("stages/", "runtime/", "pipeline/artifacts/")) for f in files), name
        assert all((REPO / f).is_file() for f in files), name


def test_export_fingerprints_the_serving_model_it_copies_and_the_engine_that_model_runs():
    from stages import export

    ext = export.fingerprint_extra(export.Config())
    assert "runtime/serving/triton_model/model.py" in ext and "runtime/serving/adapter.py" in ext
    assert any(f.startswith("runtime/engine/") for f in ext)
    assert export.fingerprint_extra(export.Config(cpu_repository=False)) is None
