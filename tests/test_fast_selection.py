"""The newcomer's selection, `python -m pytest -q -m fast` (README; under 3 minutes on 2 cores, the full suite ~25):
it must reach every package of the code. A package (a folder of pipeline/, stages/ or runtime/ holding Python
modules, less the folders pyproject.toml ships as package data) is reached when a module holding a fast test imports
one of its modules (anywhere in the module: function-level imports count). The stage modules, which tests mostly run
through the CLI, are reached by import or by a fast test that builds the tiny pipeline (`tiny_run`, or a `run_dir`
made from it: every registered stage runs and commits)."""
from __future__ import annotations

import ast
import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

REPO = Path(__file__).resolve().parent.parent
FAST = "python -m pytest -q -m fast"
# what a newcomer's checkout lacks: the real model's inputs (prepare.sh: the package index, minutes) and the vLLM
# side environment's runs
NOT_FAST = {"real_model", "vllm_tiny_run"}


COLLECT = """
import json, sys
import pytest
class Report:
    def pytest_collection_finish(self, session):
        print("FAST " + json.dumps({i.nodeid: sorted(i.fixturenames) for i in session.items}))
sys.exit(pytest.main(["--collect-only", "-q", "-m", "fast", "--strict-markers", "-p", "no:cacheprovider", "tests"],
                     plugins=[Report()]))
"""


def fast_selection() -> dict[str, list[str]]:
    """What `-m fast` selects, collected by pytest itself (markers checked strictly: a typo is an error): node id ->
    every fixture the test needs, transitively."""
    r = subprocess.run([sys.executable, "-c", COLLECT], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(next(line for line in r.stdout.splitlines() if line.startswith("FAST "))[5:])


def packages(repo: Path) -> set[str]:
    text = (repo / "pyproject.toml").read_text()                 # no tomllib: Python 3.10 is supported
    section = text.split("[tool.setuptools.package-data]")[1].split("\n[")[0]
    data = set(re.findall(r'^"([\w.]+)"\s*=', section, re.M))
    dirs = {p.parent.relative_to(repo).as_posix() for part in ("pipeline", "stages", "runtime")
            for p in (repo / part).rglob("*.py") if "__pycache__" not in p.parts}
    return {d for d in dirs if d.replace("/", ".") not in data}


@functools.cache
def reached(repo: Path, module: Path) -> frozenset[str]:
    """The project folders (and stage modules, as `stages/<name>.py`) one test module imports from."""
    names = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    out = set()
    for name in names:
        p = repo / name.replace(".", "/")
        if p.is_dir():
            out.add(p.relative_to(repo).as_posix())
        elif p.with_suffix(".py").is_file():
            out.add(p.parent.relative_to(repo).as_posix())
            if p.parent.name == "stages":
                out.add(p.with_suffix(".py").relative_to(repo).as_posix())
    return frozenset(out)


def unreached(repo: Path, selection: dict[str, list[str]]) -> list[str]:
    modules = sorted({n.split("::")[0] for n in selection})
    got = set().union(*(reached(repo, repo / m) for m in modules)) if modules else set()
    want = packages(repo) | {p.relative_to(repo).as_posix() for p in (repo / "stages").glob("*.py")
                             if p.name != "__init__.py"}
    if any("tiny_run" in fixtures for fixtures in selection.values()):
        got |= {w for w in want if w.startswith("stages/")}
    return sorted(want - got)


@pytest.fixture(scope="module")
def selected() -> dict[str, list[str]]:
    return fast_selection()


def test_the_fast_selection_reaches_every_package(selected):
    assert len(selected) >= 50, sorted(selected)
    assert unreached(REPO, selected) == [], "no fast test imports these (mark one of their tests with pytest.mark.fast)"


def test_the_fast_selection_needs_nothing_a_newcomer_lacks(selected):
    """No fast test needs the real model's inputs or a vLLM run, even through another fixture; tests that need a side
    environment (vLLM, speculators, transformers 4.57.1) skip without it, saying which, and are left out here."""
    needs = {n: sorted(NOT_FAST & set(f)) for n, f in selected.items() if NOT_FAST & set(f)}
    assert needs == {}, needs


def test_the_check_fails_when_a_package_loses_its_fast_tests(selected):
    """The checks above can fail: drop the fast modules that reach the least-reached package and it is reported; drop
    the tests that build the tiny pipeline and the stage modules no fast test imports are reported; an empty
    selection reaches nothing."""
    modules = sorted({n.split("::")[0] for n in selected})
    by_pkg = {p: [m for m in modules if p in reached(REPO, REPO / m)] for p in packages(REPO)}
    pkg = min(sorted(by_pkg), key=lambda p: len(by_pkg[p]))
    assert pkg in unreached(REPO, {n: f for n, f in selected.items() if n.split("::")[0] not in by_pkg[pkg]})
    stage_modules = {f"stages/{p.name}" for p in (REPO / "stages").glob("*.py") if p.name != "__init__.py"}
    imported = set().union(*(reached(REPO, REPO / m) for m in modules))
    no_build = {n: f for n, f in selected.items() if "tiny_run" not in f}
    assert {s for s in unreached(REPO, no_build) if s.startswith("stages/")} == stage_modules - imported
    assert unreached(REPO, {}) == sorted(packages(REPO) | stage_modules)


def test_the_readme_gives_the_fast_command_after_the_full_one():
    lines = (REPO / "README.md").read_text().split("---")[0].splitlines()
    full = next(i for i, line in enumerate(lines) if "python -m pytest -q" in line)
    assert "-m fast" not in lines[full] and any(FAST in line for line in lines[full + 1:]), lines
