"""The code a stage's output depends on: its module and every project module it reaches by import.

A stage keeps its contract and orchestration; the logic it runs lives in `runtime/` (and what it reads of other
stages in `pipeline/artifacts/`). Hashing the stage module alone would let an edit of `runtime/quant/checks.py`
leave a committed quantize artifact looking current. So a stage's code is the closure of its static imports
(module level and inside functions, where heavy imports live) over the packages in `FOLLOWED`, each file hashed
on its own: the fingerprint holds {relative path: digest}, and `plan` can say which file changed.

A file's digest is the sha256 of its code, not of its bytes: the canonical form of its AST (`_canonical`), without
comments, formatting or docstrings, the same on Python 3.10 to 3.13. A comment, a reflowed line or a reworded
docstring never reruns a stage; any change Python would execute does. (Docstrings are left out because nothing in
runtime/ reads `__doc__`; a module that ever did would need its docstring back in.) Artifacts committed before this
scheme (digests of the bytes) read as "code changed" once, `plan` counting apart the files whose bytes are those
recorded (pipeline/plan.py): `--keep` accepts them (pipeline/keep.py).

Only `runtime/` and `pipeline/artifacts/` are followed: they decide what a stage produces. The rest of `pipeline/`
(logging, reports, the runner itself) does not, and following it would re-run a two-hour training for an edit of
a progress bar.

Parsing ~130 files for each of 8 stages made a no-op rebuild take ~1 s. The imports of a file and its code digest
are a function of its bytes and its place in the tree, so they are cached on disk under that key (`code-imports.json`
in specpipe's cache directory: the names under FOLLOWED and the digest; a file edited is a new key, a cache that
cannot be read or written is ignored; the key carries `_RULES`, bumped whenever what is cached is computed
otherwise). Within one pass over the stages (`Reads`, registry.py) each file is read and hashed once and each module
name resolved once: the 8 closures share most of their ~130 files. The files are still read and their bytes hashed
on every pass (the cache key): what decides a fingerprint is the content, never a modification time.

What is not followed (the code that does not decide what a stage commits), by rule:
- imports under `if TYPE_CHECKING:` (annotations only: nothing runs);
- imports inside a module-level `report` or `report_failed` function (pipeline/stage.py: they render a committed
  artifact, never change it);
- the modules a stage declares in `EXECUTION_ONLY_CODE` ({dotted module: why}, pipeline/stage.py): code that says how
  the stage runs, not what it produces (data: the vLLM server it may start to regenerate answers, whose `vllm`
  config section data's fingerprint leaves out for the same reason). The walk does not enter such a module, nor
  the package `__init__.py` above it unless something else under that package is followed;
  tests/unit/pipeline/test_codehash.py checks each declaration names a module the stage would otherwise reach.
The shared facts several stages read live on the ground floor (runtime/hf_config.py, runtime/engine_support.py,
runtime/algorithms/), so that data, train_draft and quantize reach nothing of runtime/validate, vllm, trtllm or
serving (tests/unit/pipeline/test_codehash.py checks every file there).

`chains` gives, for each file of a closure, the shortest import chain from the stage module to it: `plan` prints it
beside a changed file, so a rerun is explained down to the file and the path by which the stage reaches it.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import tempfile
from collections import deque
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FOLLOWED = ("runtime", "pipeline.artifacts")
REPORT_HOOKS = ("report", "report_failed")    # module-level functions whose imports are not followed
_RULES = "3"        # version of what _read computes (imports, code digest): part of the cache's key


_UNDER = tuple(p + "." for p in FOLLOWED)


def _followed(name: str) -> bool:
    return name in FOLLOWED or name.startswith(_UNDER)


def module_file(name: str, root: Path = REPO) -> Path | None:
    """The source file of a dotted module name under `root` (a module or a package's __init__), or None."""
    base = os.path.join(root, *name.split("."))
    for cand in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(cand):
            return Path(cand)
    return None


class _ImportCache:
    """{"<path relative to root>:<sha256 of the bytes>:<_RULES>": {"i": [imported names], "c": code digest}}, read
    once per process, written back when it grew. Best effort: any error reading or writing it only costs a parse.
    Every edit adds an entry and every build reads the whole file, so it is kept small: when full, the entries this
    process did not use go (other checkouts sharing it re-parse their files once)."""
    MAX_ENTRIES = 3000   # ~520 bytes each: ~1.6 MB, ~9 ms to read

    def __init__(self) -> None:
        self.entries: dict[str, object] | None = None
        self.used: set[str] = set()
        self.dirty = False

    @staticmethod
    def file() -> Path:
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        return Path(os.environ.get("SPECPIPE_CACHE_DIR") or Path(base) / "specpipe") / "code-imports.json"

    def get(self, key: str) -> tuple[str, frozenset[str]] | None:
        if self.entries is None:
            try:
                doc = json.loads(self.file().read_text())
                self.entries = doc if isinstance(doc, dict) else {}
            except (OSError, ValueError):
                self.entries = {}
        hit = self.entries.get(key)
        if not (isinstance(hit, dict) and isinstance(hit.get("i"), list) and isinstance(hit.get("c"), str)):
            return None
        self.used.add(key)
        return hit["c"], frozenset(hit["i"])

    def put(self, key: str, digest: str, names: frozenset[str]) -> None:
        if self.entries is None:
            self.entries = {}
        if len(self.entries) >= self.MAX_ENTRIES:
            kept = {k: v for k, v in self.entries.items() if k in self.used}
            self.entries = kept if len(kept) < self.MAX_ENTRIES else {}
        self.entries[key] = {"i": sorted(names), "c": digest}
        self.used.add(key)
        self.dirty = True

    def flush(self) -> None:
        if not self.dirty or self.entries is None:
            return
        self.dirty = False
        f = self.file()
        try:
            f.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=f.parent, prefix=".code-imports.")
            with os.fdopen(fd, "w") as fh:
                json.dump(self.entries, fh)
            os.replace(tmp, f)
        except OSError:
            pass


_CACHE = _ImportCache()


class Reads:
    """What one pass over several closures learns once: {file: (code digest, imports)}, {module name: file or None} and
    {file: the followed files it imports} (files as absolute path strings). Only for a pass that ends before any file
    can change (registry.stages()); a new pass starts empty."""

    def __init__(self) -> None:
        self.files: dict[str, tuple[str, frozenset[str]]] = {}
        self.modules: dict[str, str | None] = {}
        self.edges: dict[str, tuple[str, ...]] = {}


def _rel(path: str, root: str) -> str:
    return path[len(root) + 1:] if path.startswith(root + os.sep) else str(Path(path).relative_to(root))


def _read(path: str, root: str, reads: Reads) -> tuple[str, frozenset[str]]:
    """(the code digest: sha256 of the canonical AST, dotted names under FOLLOWED the file imports, anywhere the
    rules follow); `from a import b` yields `a` and `a.b` (b may be a module). Cached by the bytes' sha256."""
    if (hit := reads.files.get(path)) is not None:
        return hit
    with open(path, "rb") as fh:
        data = fh.read()
    key = f"{_rel(path, root)}:{hashlib.sha256(data).hexdigest()}:{_RULES}"
    got = _CACHE.get(key)
    if got is None:
        tree = ast.parse(data, filename=path)
        got = (hashlib.sha256(_canonical(tree).encode()).hexdigest(), _parse_imports(tree, Path(path), Path(root)))
        _CACHE.put(key, *got)
    reads.files[path] = got
    return got


_DOC_HOLDERS = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _canonical(node) -> str:
    """The code of a node without what Python does not run: no comments or formatting (not in the AST), no
    docstrings, no positions; empty fields left out, so that the form is the same on every Python the project
    supports (3.12 added `type_params=[]`, 3.13's ast.dump omits empty fields). Strings and numbers as repr."""
    if isinstance(node, list):
        return "[" + ",".join(_canonical(n) for n in node) + "]"
    if not isinstance(node, ast.AST):
        return repr(node)
    parts = []
    for name, value in ast.iter_fields(node):
        if name == "body" and isinstance(node, _DOC_HOLDERS) and value and isinstance(value[0], ast.Expr) and \
                isinstance(value[0].value, ast.Constant) and isinstance(value[0].value.value, str):
            value = value[1:]           # the docstring
        if value is None or value == [] or name == "kind" and value is None:
            continue
        parts.append(f"{name}={_canonical(value)}")
    return f"{type(node).__name__}(" + ",".join(parts) + ")"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _followed_nodes(tree: ast.Module):
    """Every node of the module except what the rules leave out: the bodies of `if TYPE_CHECKING:` (not its `else`)
    and of module-level functions named in REPORT_HOOKS."""
    todo: list[ast.AST] = [n for n in tree.body
                           if not (isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name in REPORT_HOOKS)]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def _parse_imports(tree: ast.Module, path: Path, root: Path) -> frozenset[str]:
    out: set[str] = set()
    for node in _followed_nodes(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:  # relative: resolve against the importing file's package
                pkg = path.relative_to(root).parent.parts
                pkg = pkg[: len(pkg) - (node.level - 1)] if node.level > 1 else pkg
                mod = ".".join([*pkg, mod] if mod else pkg)
            out.add(mod)
            out |= {f"{mod}.{a.name}" for a in node.names}
    return frozenset(n for n in out if _followed(n))


def _module_file(name: str, root: str, reads: Reads) -> str | None:
    if name not in reads.modules:
        f = module_file(name, root)
        reads.modules[name] = None if f is None else str(f)
    return reads.modules[name]


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _kept_names(names: frozenset[str], exclude: tuple[str, ...]) -> set[str]:
    """`names` less the excluded modules, what is under them, and a package named only as their container (`from
    runtime.vllm import engine` with runtime.vllm.engine excluded); a package's __init__ still comes back through
    any other name under it (the prefixes `_reached` adds)."""
    if not exclude:
        return set(names)
    return {n for n in names if not _under(n, exclude) and not any(e.startswith(n + ".") for e in exclude)}


def _reached(path: str, root: str, reads: Reads, exclude: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Files under FOLLOWED that `path` imports directly. A package reached through `a.b.c` brings its `__init__.py`
    files too (importing a.b.c runs them). `exclude`: dotted modules not followed (EXECUTION_ONLY_CODE)."""
    key = path if not exclude else f"{path}\0{','.join(exclude)}"
    if (hit := reads.edges.get(key)) is not None:
        return hit
    prefixes: set[str] = set()
    for name in _kept_names(_read(path, root, reads)[1], exclude):
        if _followed(name):
            parts = name.split(".")
            prefixes.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    prefixes = {p for p in prefixes if not _under(p, exclude)}
    out = {f: None for p in sorted(prefixes) if _followed(p) and (f := _module_file(p, root, reads)) is not None}
    reads.edges[key] = tuple(out)
    return reads.edges[key]


def _parents(start: Path, root: Path, reads: Reads, exclude: tuple[str, ...]) -> dict[str, str | None]:
    """{file: the file it was first reached from (None for `start`)} for `start` and every file under FOLLOWED it
    reaches through imports, transitively, breadth first (so the parents give the shortest chains)."""
    first, top = str(start), str(root)
    parent: dict[str, str | None] = {first: None}
    todo = deque([first])
    while todo:
        f = todo.popleft()
        for g in _reached(f, top, reads, exclude):
            if g not in parent:
                parent[g] = f
                todo.append(g)
    _CACHE.flush()
    return parent


def _walk(start: Path, root: Path, reads: Reads, exclude: tuple[str, ...] = ()) -> dict[str, str]:
    """{file: sha256} for `start` and every file under FOLLOWED it reaches through imports, transitively."""
    top = str(root)
    return {p: _read(p, top, reads)[0] for p in _parents(start, root, reads, exclude)}


def _in_order(start: Path, files) -> list[str]:
    """`start` first, then the others in the order of their path parts (how sorted() orders Paths)."""
    first = str(start)
    return [first, *sorted((f for f in files if f != first), key=lambda f: f.split(os.sep))]


def closure(start: Path, root: Path = REPO, reads: Reads | None = None, exclude: tuple[str, ...] = ()) -> list[Path]:
    """`start` and every file under FOLLOWED it reaches through imports, transitively; sorted, `start` first."""
    return [Path(f) for f in _in_order(start, _walk(start, root, reads or Reads(), exclude))]


def code_digests(start: Path, root: Path = REPO, reads: Reads | None = None,
                 exclude: tuple[str, ...] = ()) -> dict[str, str]:
    """{path relative to root: its code digest (16 hex)} for the closure of `start`: what enters a stage's fingerprint.
    `reads`: shared by the closures of one pass (each file read once); a fresh one when not given. `exclude`: the
    stage's EXECUTION_ONLY_CODE."""
    shas = _walk(start, root, reads or Reads(), exclude)
    top = str(root)
    return {_rel(f, top): shas[f][:16] for f in _in_order(start, shas)}


def chains(start: Path, root: Path = REPO, exclude: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """{path relative to root: the shortest import chain from `start` to it, as relative paths, `start` first}."""
    parent = _parents(start, root, Reads(), exclude)
    top = str(root)
    out: dict[str, list[str]] = {}
    for f in parent:
        chain, x = [], f
        while x is not None:
            chain.append(_rel(x, top))
            x = parent[x]
        out[_rel(f, top)] = chain[::-1]
    return out


def byte_digest(path: Path) -> str:
    """sha256 (16 hex) of a file's bytes: for a file an artifact carries as a copy (export's triton_cpu model.py),
    where a comment is part of what ships."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def same_bytes(old: object, files: list[str], new: dict[str, str], root: Path = REPO) -> set[str]:
    """Of `files`, those whose digest in `old` is the sha256 of their present bytes: recorded when digests were of
    the bytes (before the AST), so only their digest was recomputed, not their code."""
    out = set()
    for f in files:
        if isinstance(old, dict) and f in new and isinstance(old.get(f), str):
            try:
                if old[f] == byte_digest(root / f):
                    out.add(f)
            except OSError:
                pass
    return out


def changed_files(old: object, new: dict[str, str]) -> list[str]:
    """Files whose digest differs between two `code_digests` results (added and removed files included); empty when
    `old` is not such a dict (an artifact committed before code was recorded per file)."""
    if not isinstance(old, dict):
        return []
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
