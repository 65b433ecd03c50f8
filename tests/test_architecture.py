"""The floor plan the code keeps (docs/architecture.md): stages over pipeline over runtime, arrows pointing down
only; stages never import each other; a stage reads another stage's config section only where its fingerprint
covers it."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from pipeline import registry

REPO = Path(__file__).resolve().parent.parent


def imported_modules(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def top(name: str) -> str:
    return name.split(".")[0]


@pytest.mark.parametrize("path", sorted((REPO / "runtime").rglob("*.py")), ids=lambda p: str(p.relative_to(REPO)))
def test_runtime_never_imports_pipeline_or_stages(path):
    up = sorted(m for m in imported_modules(path) if top(m) in ("pipeline", "stages"))
    assert not up, f"{path.relative_to(REPO)} imports {up}: runtime raises its own errors (runtime/errors.py) and " \
                   "takes what it needs as arguments"


@pytest.mark.parametrize("path", sorted((REPO / "pipeline").rglob("*.py")), ids=lambda p: str(p.relative_to(REPO)))
def test_pipeline_imports_stages_only_through_the_registry(path):
    if path.name == "registry.py":
        return
    assert not sorted(m for m in imported_modules(path) if top(m) == "stages")


def test_stages_never_import_each_other():
    for spec in registry.stages():
        path = Path(spec.module.__file__)
        other = sorted(m for m in imported_modules(path) if m.startswith("stages.") and m != spec.module.__name__)
        assert not other, f"{path.name} imports {other}"


def upstream(spec) -> set[str]:
    seen, todo = set(), list(spec.consumes)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo += list(registry.get(n).consumes)
    return seen


def test_cross_section_reads_enter_the_fingerprint():
    """`ctx.config.<section>` / `cfg.<section>` in a stage module is its own section, `run` (never fingerprinted:
    where it runs), a section it declares in USES, or the section of a stage it consumes (directly or through
    another stage: that stage's fingerprint holds the section)."""
    sections = {s.name for s in registry.stages()} | {"hardware", "run"}
    for spec in registry.stages():
        src = Path(spec.module.__file__).read_text()
        read = set(re.findall(r"\b(?:ctx\.config|cfg)\.([a-z_]+)\b", src)) & sections
        allowed = {spec.name, "run"} | set(spec.uses) | upstream(spec)
        assert read <= allowed, f"stages/{spec.name}.py reads config sections {sorted(read - allowed)} that are " \
                                "not in its fingerprint: list them in USES"


MAX_LINES = 450


@pytest.mark.parametrize("part", ["pipeline", "stages", "runtime", "bench"])
def test_no_source_module_is_over_450_lines(part):
    """A module is one concept a reader looks for (docs/architecture.md says which); past 450 lines it is two."""
    long = {str(p.relative_to(REPO)): n for p in sorted((REPO / part).rglob("*.py"))
            if "prepared" not in p.parts and (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines: {long}: split it along its concepts (a stage keeps its contract and " \
                     "orchestration, its logic goes to a runtime/ subpackage)"


MAX_FUNCTION_LINES = 60


@pytest.mark.parametrize("part", ["pipeline", "stages", "runtime", "bench"])
def test_no_function_is_over_60_lines(part):
    """ruff caps statements (PLR0915, 50); this caps what a reader scrolls through: def line to last line, docstring
    included. A long procedure is a short function calling named steps."""
    long = {}
    for p in sorted((REPO / part).rglob("*.py")):
        if "prepared" in p.parts:
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= MAX_FUNCTION_LINES:
                long[f"{p.relative_to(REPO)}:{node.lineno} {node.name}"] = node.end_lineno - node.lineno + 1
    assert not long, f"over {MAX_FUNCTION_LINES} lines: {long}"
