"""The floor plan the code keeps (docs/architecture.md): stages over pipeline over runtime, arrows pointing down
only; stages never import each other; a stage reads another stage's config section only where its fingerprint
covers it."""
from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

import pytest

from pipeline import registry

from support import REPO


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


# ---------------------------------------------------------------------------------------------- import cycles

PACKAGES = ("pipeline", "stages", "runtime", "bench")
# Cycles allowed to remain, each as the set of its modules, with the reason. None today; a new entry needs a reason
# a reader accepts (a function-level import that hides a cycle is still a cycle: the two modules are one concept).
KNOWN_CYCLES: list[frozenset[str]] = []


def module_files(root: Path, packages=PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the given top-level packages (a package is its __init__)."""
    out = {}
    for part in packages:
        for p in sorted((root / part).rglob("*.py")):
            if "prepared" in p.parts:
                continue
            rel = p.relative_to(root).with_suffix("").parts
            out[".".join(rel[:-1] if rel[-1] == "__init__" else rel)] = p
    return out


def import_graph(root: Path, packages=PACKAGES) -> dict[str, dict[str, int]]:
    """module -> {project module it imports: line of the first such import}, from the AST: every import statement
    counts, at module level, inside functions and under `if TYPE_CHECKING:` alike. `from a.b import c` imports the
    module a.b.c when there is one, else a.b; an import of a name resolves to the longest project module prefix.
    Imports through importlib with a computed name are not seen."""
    files = module_files(root, packages)

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for mod, path in files.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:                                   # relative: from the package, level - 1 up
                    parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                names = [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for n in names:
                target = resolve(n)
                if target is not None and target != mod:
                    edges.setdefault(target, node.lineno)
        graph[mod] = edges
    return graph


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (a closed path, first module repeated at the end) per strongly connected component of more than
    one module: the shortest way from the component's first module back to itself."""
    index, low, stack, on, comps = {}, {}, [], set(), []

    def connect(v):                                          # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while not comp or w != v:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
            if len(comp) > 1:
                comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    cycles = []
    for comp in comps:
        start = min(comp)
        prev, todo = {}, [start]
        while start not in prev:                             # breadth first inside the component
            nxt = []
            for v in todo:
                for w in sorted(graph[v]):
                    if w in comp and w not in prev:
                        prev[w] = v
                        nxt.append(w)
            todo = nxt
        path = [start]
        while len(path) == 1 or path[-1] != start:
            path.append(prev[path[-1]])
        cycles.append(path[::-1])
    return sorted(cycles)


def describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    """`a:line -> b:line -> a`: each module with the line of its import of the next."""
    return " -> ".join(f"{a}:{graph[a][b]}" for a, b in itertools.pairwise(cycle)) + f" -> {cycle[-1]}"


def test_no_import_cycles_between_the_projects_modules():
    """The modules of pipeline/, stages/, runtime/ and bench/ import each other in one direction only: no cycle,
    counting the imports inside functions and under TYPE_CHECKING (an import moved into a function still makes the
    two modules depend on each other; it only hides it from Python's import order)."""
    graph = import_graph(REPO)
    assert len(graph) > 100 and graph["runtime.engine.speculative"], "the graph must see the project's modules"
    found = [c for c in import_cycles(graph) if frozenset(c) not in KNOWN_CYCLES]
    assert not found, "import cycles (module:line of its import of the next -> ...):\n" + "\n".join(
        describe(c, graph) for c in found)


def test_the_cycle_check_sees_imports_in_functions_and_under_type_checking(tmp_path):
    """The check above can fail: a package whose modules import each other only inside a function and under
    TYPE_CHECKING is reported, with the lines, and one import direction alone is not."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from pkg.b import B\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import a\n\n    return a\n")
    (pkg / "c.py").write_text("import pkg.b\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.a"] == {"pkg.b": 4} and graph["pkg.b"] == {"pkg.a": 2} and graph["pkg.c"] == {"pkg.b": 1}
    assert import_cycles(graph) == [["pkg.a", "pkg.b", "pkg.a"]]
    assert describe(import_cycles(graph)[0], graph) == "pkg.a:4 -> pkg.b:2 -> pkg.a"
    (pkg / "b.py").write_text("def f():\n    return 1\n")
    assert import_cycles(import_graph(tmp_path, ("pkg",))) == []


# ---------------------------------------------------------------------------------------------- the test tree

TIERS = ("unit", "integration", "e2e")    # by what a test needs (tests/unit/test_tiers.py checks which tier)
TREE_WIDE = {"test_architecture.py", "test_tiers.py"}   # checks on the whole tree, at tests/unit/ itself


def suite_modules(repo: Path) -> list[Path]:
    return sorted(p for p in (repo / "tests").rglob("test_*.py") if "__pycache__" not in p.parts)


def misplaced_tests(repo: Path) -> dict[str, str]:
    """Test modules outside the mirror of the code (docs/architecture.md) inside a tier folder: tests/<tier>/pipeline/,
    tests/<tier>/stages/, tests/<tier>/runtime/ (runtime/'s own modules) or tests/<tier>/runtime/<package>/ naming a
    runtime package; at tests/<tier>/ itself the modules that run the CLI across stages (the whole pipeline, serving,
    Slurm, the containers) and, in tests/unit/, the checks on the whole tree."""
    out = {}
    where = "not in tests/<unit|integration|e2e>/{pipeline,stages,runtime/<package>}/"
    for p in suite_modules(repo):
        parts = p.relative_to(repo / "tests").parts
        if len(parts) < 2 or parts[0] not in TIERS:
            ok = False
        elif len(parts) == 2:
            ok = parts[1] not in TREE_WIDE or parts[0] == "unit"
        elif len(parts) == 3:
            ok = parts[1] in ("pipeline", "stages", "runtime")
        else:
            ok = len(parts) == 4 and parts[1] == "runtime" and (repo / "runtime" / parts[2] / "__init__.py").is_file()
        if not ok:
            out[p.relative_to(repo).as_posix()] = where
    seen: dict[str, Path] = {}
    for p in suite_modules(repo):   # pytest imports test modules by basename (prepend mode, no __init__.py)
        if p.name in seen:
            out[p.relative_to(repo).as_posix()] = f"same basename as {seen[p.name].relative_to(repo).as_posix()}"
        seen.setdefault(p.name, p)
    return out


def imports_of_test_modules(repo: Path) -> list[str]:
    """Imports of one test module by another (inside functions too): shared helpers belong in tests/support/."""
    names = {p.stem for p in suite_modules(repo)}
    out = []
    for p in suite_modules(repo):
        for node in ast.walk(ast.parse(p.read_text())):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                    [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
            out += [f"{p.relative_to(repo).as_posix()}:{node.lineno} imports {m}" for m in mods if top(m) in names]
    return out


def test_the_tests_mirror_the_code_and_import_no_other_test_module():
    assert len(suite_modules(REPO)) > 40
    assert misplaced_tests(REPO) == {}, "move them where the code they test lives (docs/architecture.md)"
    assert imports_of_test_modules(REPO) == [], "move what they share to tests/support/"


def test_the_test_tree_check_can_fail(tmp_path):
    (tmp_path / "runtime" / "engine").mkdir(parents=True)
    (tmp_path / "runtime" / "engine" / "__init__.py").write_text("")
    files = {"tests/unit/runtime/engine/test_a.py": "def f():\n    from test_b import x\n",
             "tests/unit/runtime/nosuch/test_b.py": "", "tests/test_c.py": "import test_a.sub\n",
             "tests/integration/stages/test_a.py": "", "tests/e2e/pipeline/test_d.py": "", "tests/support/test_e.py": "",
             "tests/stages/test_f.py": "", "tests/integration/test_g.py": "", "tests/e2e/test_architecture.py": "",
             "tests/unit/test_tiers.py": "", "tests/unit/other/test_h.py": ""}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    where = "not in tests/<unit|integration|e2e>/{pipeline,stages,runtime/<package>}/"
    assert misplaced_tests(tmp_path) == {
        "tests/unit/runtime/nosuch/test_b.py": where, "tests/test_c.py": where, "tests/support/test_e.py": where,
        "tests/stages/test_f.py": where, "tests/e2e/test_architecture.py": where, "tests/unit/other/test_h.py": where,
        "tests/unit/runtime/engine/test_a.py": "same basename as tests/integration/stages/test_a.py"}
    assert imports_of_test_modules(tmp_path) == ["tests/test_c.py:1 imports test_a.sub",
                                             "tests/unit/runtime/engine/test_a.py:2 imports test_b"]


# A path the code or the docs name (`runtime/engine/speculative.py`, `docs/stages/tune.md`, `runtime/vllm/engine.VllmServer`)
# names a file or folder that is there. Outside tests/ (whose synthetic trees name files on purpose); paths under
# bench/real_model/prepared are built by prepare.sh; the one below names an old layout on purpose (a baseline revision).
_PATH_REF = re.compile(r"(?<![\w/.-])((?:pipeline|stages|runtime|tests|bench|configs|containers|docs)/[\w./-]*\w)")
_PATHS_NAMED_ON_PURPOSE = {"runtime/speculative.py"}     # bench/real_model/bench_steps.py: the pre-subpackage layout


def stale_paths(root: Path, files: list[Path]) -> dict[str, str]:
    """{named path: the first file naming it} for every named path that is not under `root`."""
    bad: dict[str, str] = {}
    for f in files:
        for m in _PATH_REF.finditer(f.read_text(errors="replace")):
            ref = m.group(1).split("::")[0]
            folder, _, last = ref.rpartition("/")   # module.attr: runtime/vllm/engine.VllmServer -> runtime/vllm/engine.py
            candidates = [ref, f"{folder}/{last.split('.')[0]}.py"]
            candidates += [str((f.parent / ref).relative_to(root)) if (f.parent / ref).exists() else ""]   # relative links
            if ref.startswith("bench/real_model/prepared") or ref in _PATHS_NAMED_ON_PURPOSE:
                continue
            if not any(c and (root / c).exists() for c in candidates):
                bad.setdefault(ref, str(f.relative_to(root)))
    return bad


def _named_files(root: Path) -> list[Path]:
    out = [p for d in ("pipeline", "stages", "runtime", "bench", "configs", "containers", "docs")
           for p in (root / d).rglob("*") if p.suffix in (".py", ".md", ".yaml", ".sh") and p.is_file()]
    return out + [root / "README.md"]


def test_paths_the_code_and_docs_name_exist():
    assert stale_paths(REPO, _named_files(REPO)) == {}


def test_the_stale_path_check_can_fail(tmp_path):
    (tmp_path / "runtime" / "engine").mkdir(parents=True)
    (tmp_path / "runtime" / "engine" / "speculative.py").write_text('"""Called from runtime/engine/decode_batch.py and '
                                                                    'runtime/engine/speculative.Speculator."""\n')
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("see [tune](stages/tune.md) and runtime/engine/speculative.py")
    (tmp_path / "docs" / "stages").mkdir()
    (tmp_path / "docs" / "stages" / "tune.md").write_text("")
    files = [tmp_path / "runtime" / "engine" / "speculative.py", tmp_path / "docs" / "a.md"]
    assert stale_paths(tmp_path, files) == {"runtime/engine/decode_batch.py": "runtime/engine/speculative.py"}
