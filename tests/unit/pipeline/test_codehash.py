"""A stage's fingerprint covers the runtime code it runs (pipeline/codehash.py): an edit of a runtime module a stage
reaches re-runs that stage, an edit of one it does not reach leaves it current."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pipeline import codehash, registry

from support import REPO


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
    assert f"runtime/a.py:{hashlib.sha256((root / 'runtime/a.py').read_bytes()).hexdigest()}:{codehash._RULES}" in cached
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


# ---------------------------------------------------------------- what decides an artifact (issue 44)

LATE = ("runtime/vllm", "runtime/trtllm", "runtime/serving", "runtime/validate")   # run, report and export code
EARLY = ("target", "data", "train_draft", "quantize")                               # the days-of-GPU stages


def test_no_file_of_vllm_trtllm_serving_or_validate_is_in_an_early_stage_fingerprint():
    """Every file under runtime/vllm, runtime/trtllm, runtime/serving and runtime/validate, checked one by one: none is
    in the code fingerprint of target, data, train_draft or quantize, so touching it leaves them up to date (main at
    17f2668: data reached 8 of them through runtime/data/regen_engines.py, train_draft and quantize 2 through
    runtime/trtllm/hf_config.py)."""
    code = {s.name: set(s.code) for s in registry.stages()}
    files = sorted(p.relative_to(REPO).as_posix() for d in LATE for p in (REPO / d).rglob("*")
                   if p.is_file() and "__pycache__" not in p.parts)
    assert len(files) > 30                       # the walk saw the folders
    reached = {(f, st) for f in files for st in EARLY if f in code[st]}
    assert reached == set()
    # the check bites: the late stages do reach these folders
    assert any(f.startswith("runtime/validate/") for f in code["validate"])
    assert any(f.startswith("runtime/vllm/") for f in code["export"])


def test_each_execution_only_declaration_names_a_module_the_stage_would_otherwise_reach():
    """EXECUTION_ONLY_CODE (pipeline/stage.py) hides a module from one stage's fingerprint: each entry names an existing
    module, says why, and is live (without it the stage's closure holds the module), so a stale entry cannot hide
    code the stage no longer imports that way, nor hide a module it never reached."""
    declared = [(s, mod, why) for s in registry.stages() for mod, why in getattr(s.module, "EXECUTION_ONLY_CODE", {}).items()]
    assert declared, "data declares the vLLM server it may start"
    for spec, mod, why in declared:
        f = codehash.module_file(mod)
        assert f is not None and why.strip(), (spec.name, mod)
        rel = f.relative_to(REPO).as_posix()
        assert rel not in spec.code
        assert rel in codehash.code_digests(spec.file), f"{spec.name}: EXECUTION_ONLY_CODE {mod} is not reached anyway"


def test_report_hooks_type_checking_and_declared_modules_are_not_followed(tmp_path):
    """The rules of codehash.py: imports inside a module-level report/report_failed, under `if TYPE_CHECKING:` and
    into an excluded module (with a package __init__ reached only as its container) are not followed; the same
    imports elsewhere are."""
    files = {
        "stages/s.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from runtime.t import T\nelse:\n"
                       "    from runtime.e import E\n\ndef run(ctx):\n    from runtime.a import f\n"
                       "    from runtime.pkg import srv\n    return f()\n\ndef report(artifact):\n"
                       "    from runtime.r import render\n    return render()\n\n"
                       "def report_failed(metrics):\n    from runtime.r2 import x\n",
        "runtime/__init__.py": "", "runtime/a.py": "def f():\n    return 1\n", "runtime/t.py": "T = 1\n",
        "runtime/e.py": "E = 1\n", "runtime/r.py": "def render():\n    return ''\n", "runtime/r2.py": "x = 1\n",
        "runtime/pkg/__init__.py": "", "runtime/pkg/srv.py": "from runtime import a\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    stage = tmp_path / "stages/s.py"
    got = set(codehash.code_digests(stage, tmp_path, exclude=("runtime.pkg.srv",)))
    assert got == {"stages/s.py", "runtime/__init__.py", "runtime/a.py", "runtime/e.py"}
    assert {"runtime/pkg/__init__.py", "runtime/pkg/srv.py"} <= set(codehash.code_digests(stage, tmp_path))
    # the same import outside the hooks is followed
    (tmp_path / "stages/s.py").write_text(files["stages/s.py"] + "\ndef other():\n    from runtime.r import render\n")
    assert "runtime/r.py" in codehash.code_digests(stage, tmp_path, exclude=("runtime.pkg.srv",))


def test_a_comment_or_docstring_changes_no_digest_and_a_code_edit_does(tmp_path):
    """Digests are of the code (the canonical AST): a comment, a reflowed expression or a reworded docstring leave the
    fingerprint as it was; a changed constant changes it, and `chains` names the path by which the stage reaches it."""
    stage = _tree(tmp_path)
    before = codehash.code_digests(stage, tmp_path)
    deep = tmp_path / "runtime/sub/deep.py"
    deep.write_text('"""A docstring."""\n# a comment\n\n\ndef h(x):\n    """Why."""\n    return (\n        x\n    )  # same\n')
    assert codehash.code_digests(stage, tmp_path) == before
    deep.write_text("def h(x):\n    return x + 1\n")
    assert codehash.changed_files(before, codehash.code_digests(stage, tmp_path)) == ["runtime/sub/deep.py"]
    assert codehash.chains(stage, tmp_path)["runtime/sub/deep.py"] == [
        "stages/s.py", "runtime/a.py", "runtime/b.py", "runtime/sub/deep.py"]
