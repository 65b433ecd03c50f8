"""The code a stage's output depends on: its module and every project module it reaches by import.

A stage keeps its contract and orchestration; the logic it runs lives in `runtime/` (and what it reads of other
stages in `pipeline/artifacts/`). Hashing the stage module alone would let an edit of `runtime/quant/checks.py`
leave a committed quantize artifact looking current. So a stage's code is the closure of its static imports
(module level and inside functions, where heavy imports live) over the packages in `FOLLOWED`, each file hashed
on its own: the fingerprint holds {relative path: sha256}, and `plan` can say which file changed.

Only `runtime/` and `pipeline/artifacts/` are followed: they decide what a stage produces. The rest of `pipeline/`
(logging, reports, the runner itself) does not, and following it would re-run a two-hour training for an edit of
a progress bar.

Parsing ~130 files for each of 8 stages made a no-op rebuild take ~1 s. The imports of a file are a function of its
bytes and its place in the tree, so they are cached on disk under that key (`code-imports.json` in specpipe's cache
directory; a file edited is a new key, a cache that cannot be read or written is ignored). Within one pass over the
stages (`Reads`, registry.py) each file is read and hashed once and each module name resolved once: the ~8 closures
share most of their files.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FOLLOWED = ("runtime", "pipeline.artifacts")


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
    """{"<path relative to root>:<sha256 of the bytes>": [imported names]}, read once per process, written back when
    it grew. Best effort: any error reading or writing it only costs a parse."""
    MAX_ENTRIES = 20000

    def __init__(self) -> None:
        self.entries: dict[str, list[str]] | None = None
        self.dirty = False

    @staticmethod
    def file() -> Path:
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        return Path(os.environ.get("SPECPIPE_CACHE_DIR") or Path(base) / "specpipe") / "code-imports.json"

    def get(self, key: str) -> frozenset[str] | None:
        if self.entries is None:
            try:
                doc = json.loads(self.file().read_text())
                self.entries = doc if isinstance(doc, dict) else {}
            except (OSError, ValueError):
                self.entries = {}
        hit = self.entries.get(key)
        return frozenset(hit) if isinstance(hit, list) else None

    def put(self, key: str, names: frozenset[str]) -> None:
        if self.entries is None or len(self.entries) >= self.MAX_ENTRIES:
            self.entries = {}
        self.entries[key] = sorted(names)
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
    """What one pass over several closures learns once: {file: (sha256, imports)}, {module name: file or None} and
    {file: the followed files it imports}. Only for a pass that ends before any file can change (registry.stages());
    a new pass starts empty."""

    def __init__(self) -> None:
        self.files: dict[Path, tuple[str, frozenset[str]]] = {}
        self.modules: dict[str, Path | None] = {}
        self.edges: dict[Path, tuple[Path, ...]] = {}


def _read(path: Path, root: Path, reads: Reads) -> tuple[str, frozenset[str]]:
    """(sha256 of the bytes, dotted names the file imports, anywhere in it); `from a import b` yields `a` and `a.b`
    (b may be a module)."""
    if path in reads.files:
        return reads.files[path]
    data = path.read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    key = f"{path.relative_to(root)}:{sha}"
    hit = _CACHE.get(key)
    if hit is None:
        hit = _parse_imports(data, path, root)
        _CACHE.put(key, hit)
    reads.files[path] = (sha, hit)
    return sha, hit


def _parse_imports(data: bytes, path: Path, root: Path) -> frozenset[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(data, filename=str(path))):
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
    return frozenset(out)


def _reached(path: Path, root: Path, reads: Reads) -> tuple[Path, ...]:
    """Files under FOLLOWED that `path` imports directly. A package reached through `a.b.c` brings its `__init__.py`
    files too (importing a.b.c runs them)."""
    if (hit := reads.edges.get(path)) is not None:
        return hit
    out: dict[Path, None] = {}
    for name in _read(path, root, reads)[1]:
        if not _followed(name):
            continue
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            if not _followed(prefix := ".".join(parts[:i])):
                continue
            if prefix not in reads.modules:
                reads.modules[prefix] = module_file(prefix, root)
            if (f := reads.modules[prefix]) is not None:
                out[f] = None
    reads.edges[path] = tuple(out)
    return reads.edges[path]


def _walk(start: Path, root: Path, reads: Reads) -> dict[Path, str]:
    """{file: sha256} for `start` and every file under FOLLOWED it reaches through imports, transitively."""
    seen: dict[Path, None] = {start: None}
    todo = [start]
    while todo:
        for f in _reached(todo.pop(), root, reads):
            if f not in seen:
                seen[f] = None
                todo.append(f)
    _CACHE.flush()
    return {p: _read(p, root, reads)[0] for p in seen}


def closure(start: Path, root: Path = REPO, reads: Reads | None = None) -> list[Path]:
    """`start` and every file under FOLLOWED it reaches through imports, transitively; sorted, `start` first."""
    return [start, *sorted(p for p in _walk(start, root, reads or Reads()) if p != start)]


def code_digests(start: Path, root: Path = REPO, reads: Reads | None = None) -> dict[str, str]:
    """{path relative to root: sha256 of its bytes} for the closure of `start`: what enters a stage's fingerprint.
    `reads`: shared by the closures of one pass (each file read once); a fresh one when not given."""
    shas = _walk(start, root, reads or Reads())
    return {str(p.relative_to(root)): shas[p][:16] for p in [start, *sorted(p for p in shas if p != start)]}


def changed_files(old: object, new: dict[str, str]) -> list[str]:
    """Files whose digest differs between two `code_digests` results (added and removed files included); empty when
    `old` is not such a dict (an artifact committed before code was recorded per file)."""
    if not isinstance(old, dict):
        return []
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
