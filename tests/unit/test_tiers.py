"""The tests are tiered by folder, by what a test needs (docs/architecture.md, "Tests"):

    tests/unit/         nothing prepared: the project's environment and this checkout only. The newcomer's command,
                        `python -m pytest -q tests/unit` (README): under 3 minutes on 2 cores on a fresh clone.
    tests/integration/  the tiny pipeline built through its stages (`tiny_run`, `run_dir`, `vllm_tiny_run`), a side
                        environment (vLLM, speculators, transformers 4.57.1) or a Debian tool, a server process
                        (Triton, vLLM, `specpipe serve`, Slurm's daemons), or minutes of CPU (`pytest.mark.slow`).
    tests/e2e/          the real model's inputs (`real_model`: SmolLM2-135M-Instruct and its prompt sets, made by
                        `bash bench/real_model/prepare.sh`).

A test module's tier is the highest its tests need; it lives in that tier's folder (below it, the mirror of the code:
pipeline/, stages/, runtime/<package>/; tests/unit/test_architecture.py). This module checks both rules, and that the unit
tier still reaches every package of the code. A script that moves modules to their tier uses `module_tiers` below
(the rule lives here only)."""
from __future__ import annotations

import ast
import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support import REPO

TIERS = ("unit", "integration", "e2e")
UNIT = "python -m pytest -q tests/unit"
# what a test needs, by the fixtures it uses (pytest's closure: through other fixtures too) and its markers
E2E_FIXTURES = {"real_model"}
INTEGRATION_FIXTURES = {"tiny_run", "run_dir", "vllm_tiny_run"}
INTEGRATION_MARKERS = {"slow"}
# ... and by what its module calls or reads: a side environment or a Debian tool that may be missing (`missing`, the
# side environments' variables), a server process
INTEGRATION_CALLS = {"missing", "vllm_install", "find_vllm", "cli_server"}
INTEGRATION_IMPORTS = {"support.serve", "support.vllm_env"}
INTEGRATION_STRINGS = re.compile(r"^SPECPIPE_(SPECULATORS|TF457|VLLM)_PYTHON$|^(tritonserver|slurmctld)$")
E2E_NAMES = {"REAL_CONFIG", "REAL_DIR"}     # conftest's real-model config and prepared folder

COLLECT = """
import json, sys
import pytest
class Report:
    def pytest_collection_finish(self, session):
        print("TESTS " + json.dumps({i.nodeid: [sorted(i.fixturenames), sorted({m.name for m in i.iter_markers()})]
                                     for i in session.items}))
sys.exit(pytest.main(["--collect-only", "-q", "--strict-markers", "-p", "no:cacheprovider", *sys.argv[1:]],
                     plugins=[Report()]))
"""


def collect(repo: Path, *paths: str) -> dict[str, tuple[list[str], list[str]]]:
    """Every test pytest collects under `paths` (markers checked strictly: a typo is an error): node id -> (every
    fixture it needs, transitively; its markers)."""
    r = subprocess.run([sys.executable, "-c", COLLECT, *(paths or ("tests",))], cwd=repo, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(next(line for line in r.stdout.splitlines() if line.startswith("TESTS "))[6:])


def module_signals(path: Path) -> dict[str, str]:
    """What a module's source needs beyond its fixtures: tier -> the first name that says so."""
    out: dict[str, str] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        name = None
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            arg = node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else None
            if name == "getfixturevalue" and arg in E2E_FIXTURES:      # a fixture asked for at run time
                out.setdefault("e2e", f"getfixturevalue({arg!r})")
            name = f"getfixturevalue({arg!r})" if name == "getfixturevalue" and arg in INTEGRATION_FIXTURES else \
                name if name in INTEGRATION_CALLS else None
        elif isinstance(node, ast.ImportFrom) and node.module in INTEGRATION_IMPORTS:
            name = node.module
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and INTEGRATION_STRINGS.match(node.value):
            name = node.value
        elif isinstance(node, ast.Name) and node.id in E2E_NAMES:
            out.setdefault("e2e", node.id)
        if name:
            out.setdefault("integration", name)
    return out


def tier_of_test(fixtures: list[str], markers: list[str]) -> tuple[str, str]:
    """(tier, why) of one test from its fixtures and markers."""
    if need := sorted(E2E_FIXTURES & set(fixtures)):
        return "e2e", f"fixture {need[0]}"
    if need := sorted(INTEGRATION_FIXTURES & set(fixtures)):
        return "integration", f"fixture {need[0]}"
    if need := sorted(INTEGRATION_MARKERS & set(markers)):
        return "integration", f"marker {need[0]}"
    return "unit", ""


def module_tiers(repo: Path, tests: dict[str, tuple[list[str], list[str]]]) -> dict[str, tuple[str, str]]:
    """Test module (path from the repository root) -> (the highest tier its tests need, why)."""
    out: dict[str, tuple[str, str]] = {}
    for nodeid, (fixtures, markers) in tests.items():
        mod = nodeid.split("::")[0]
        if mod not in out:
            sig = module_signals(repo / mod)
            out[mod] = max([("unit", "")] + [(t, f"calls/names {w}") for t, w in sig.items()], key=lambda x: TIERS.index(x[0]))
        tier, why = tier_of_test(fixtures, markers)
        if TIERS.index(tier) > TIERS.index(out[mod][0]):
            out[mod] = (tier, f"{nodeid.split('::', 1)[1]}: {why}")
    return out


def folder_tier(module: str) -> str | None:
    parts = Path(module).parts
    return parts[1] if len(parts) > 2 and parts[0] == "tests" and parts[1] in TIERS else None


def misfiled(tiers: dict[str, tuple[str, str]]) -> dict[str, str]:
    """Modules outside the tier folders, or in a lower tier's folder than their tests need."""
    out = {}
    for mod, (tier, why) in sorted(tiers.items()):
        where = folder_tier(mod)
        if where is None:
            out[mod] = f"not in tests/{{{','.join(TIERS)}}}/ (its tier: {tier}{', ' + why if why else ''})"
        elif TIERS.index(tier) > TIERS.index(where):
            out[mod] = f"in tests/{where}/ but needs {tier}: {why}"
    return out


def loose_modules(repo: Path = REPO) -> list[str]:
    """test_*.py files anywhere under tests/ outside the tier folders (pytest collects them all)."""
    return sorted(p.relative_to(repo).as_posix() for p in (repo / "tests").rglob("test_*.py")
                  if "__pycache__" not in p.parts and folder_tier(p.relative_to(repo).as_posix()) is None)


@pytest.fixture(scope="module")
def collected() -> dict[str, tuple[list[str], list[str]]]:
    return collect(REPO)


def test_every_test_module_lives_in_the_folder_of_its_tier(collected):
    assert len(collected) > 500
    assert loose_modules() == [], "move them into tests/unit, tests/integration or tests/e2e"
    assert misfiled(module_tiers(REPO, collected)) == {}, "move them to the tier they need (docs/architecture.md)"


def test_the_tier_check_can_fail(tmp_path):
    """A module outside the tiers is reported, so is a unit module that builds the tiny pipeline, reads the real
    model (a fixture asked for at run time too), trains (slow) or calls a side environment, and an integration module
    that reads the real model."""
    files = {"tests/test_loose.py": "", "tests/unit/stages/test_a.py": "def test_a(run_dir):\n    pass\n",
             "tests/unit/stages/test_f.py": "def test_f(request):\n    request.getfixturevalue('real_model')\n",
             "tests/unit/stages/test_b.py": "from support import missing\ndef test_b():\n    missing('x')\n",
             "tests/unit/runtime/test_c.py": "", "tests/integration/test_d.py": "", "tests/unit/test_e.py": ""}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    tests = {"tests/test_loose.py::test_x": ([], []), "tests/unit/stages/test_a.py::test_a": (["run_dir", "tiny_run"], []),
             "tests/unit/stages/test_b.py::test_b": ([], []),
             "tests/unit/runtime/test_c.py::test_c": (["tmp_path"], ["slow", "parametrize"]),
             "tests/integration/test_d.py::test_d[1]": (["real_model"], []), "tests/unit/test_e.py::test_e": ([], []),
             "tests/unit/stages/test_f.py::test_f": (["request"], [])}
    got = misfiled(module_tiers(tmp_path, tests))
    assert got == {
        "tests/test_loose.py": "not in tests/{unit,integration,e2e}/ (its tier: unit)",
        "tests/unit/stages/test_a.py": "in tests/unit/ but needs integration: test_a: fixture run_dir",
        "tests/unit/stages/test_b.py": "in tests/unit/ but needs integration: calls/names missing",
        "tests/unit/stages/test_f.py": "in tests/unit/ but needs e2e: calls/names getfixturevalue('real_model')",
        "tests/unit/runtime/test_c.py": "in tests/unit/ but needs integration: test_c: marker slow",
        "tests/integration/test_d.py": "in tests/integration/ but needs e2e: test_d[1]: fixture real_model"}
    assert loose_modules(tmp_path) == ["tests/test_loose.py"]


# ---------------------------------------------------------------------------------- the unit tier reaches the code

def packages(repo: Path) -> set[str]:
    """The folders of pipeline/, stages/ and runtime/ holding Python modules, less those pyproject.toml ships as
    package data."""
    text = (repo / "pyproject.toml").read_text()                 # no tomllib: Python 3.10 is supported
    section = text.split("[tool.setuptools.package-data]")[1].split("\n[")[0]
    data = set(re.findall(r'^"([\w.]+)"\s*=', section, re.M))
    dirs = {p.parent.relative_to(repo).as_posix() for part in ("pipeline", "stages", "runtime")
            for p in (repo / part).rglob("*.py") if "__pycache__" not in p.parts}
    return {d for d in dirs if d.replace("/", ".") not in data}


@functools.cache
def reached(repo: Path, module: Path) -> frozenset[str]:
    """The project folders (and stage modules, as `stages/<name>.py`) one test module imports from (anywhere in the
    module: function-level imports count) or loads by dotted name (a string such as "stages.config", which the
    registry imports); and the stage modules its name mirrors (tests/<tier>/stages/test_target_data.py: stages/target.py
    and stages/data.py, which it runs through the CLI)."""
    names = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"(pipeline|stages|runtime)(\.\w+)+",
                                                                                            node.value):
            names.add(node.value)
    if module.parent.name == "stages":
        names |= {f"stages.{part}" for part in module.stem.split("_")[1:]}
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


def unreached(repo: Path, modules: list[str]) -> list[str]:
    got = set().union(*(reached(repo, repo / m) for m in modules)) if modules else set()
    want = packages(repo) | {p.relative_to(repo).as_posix() for p in (repo / "stages").glob("*.py")
                             if p.name != "__init__.py"}
    return sorted(want - got)


def test_the_unit_tier_reaches_every_package(collected):
    unit = sorted({n.split("::")[0] for n in collected if folder_tier(n.split("::")[0]) == "unit"})
    assert len(unit) >= 20, unit
    assert unreached(REPO, unit) == [], "no unit test module imports these: give them a unit test"


def test_the_reach_check_can_fail(collected):
    """Drop the unit modules that reach the least-reached package and it is reported; nothing reaches nothing."""
    unit = sorted({n.split("::")[0] for n in collected if folder_tier(n.split("::")[0]) == "unit"})
    by_pkg = {p: [m for m in unit if p in reached(REPO, REPO / m)] for p in packages(REPO)}
    pkg = min(sorted(by_pkg), key=lambda p: len(by_pkg[p]))
    assert pkg in unreached(REPO, [m for m in unit if m not in by_pkg[pkg]])
    stage_modules = {f"stages/{p.name}" for p in (REPO / "stages").glob("*.py") if p.name != "__init__.py"}
    assert unreached(REPO, []) == sorted(packages(REPO) | stage_modules)


def test_the_readme_gives_the_unit_command_after_the_full_one():
    lines = (REPO / "README.md").read_text().split("---")[0].splitlines()
    full = next(i for i, line in enumerate(lines) if "python -m pytest -q" in line)
    assert "tests/" not in lines[full] and any(UNIT in line for line in lines[full + 1:]), lines
