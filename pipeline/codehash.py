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
directory, only the names under FOLLOWED; a file edited is a new key, a cache that cannot be read or written is
ignored). Within one pass over the stages (`Reads`, registry.py) each file is read and hashed once and each module
name resolved once: the 8 closures share most of their ~130 files. The files are still read and hashed on every
pass: what decides a fingerprint is the bytes, never a modification time.
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
    it grew. Best effort: any error reading or writing it only costs a parse. Every edit adds an entry and every
    build reads the whole file, so it is kept small: when full, the entries this process did not use go (other
    checkouts sharing it re-parse their files once)."""
    MAX_ENTRIES = 3000   # ~440 bytes each: ~1.3 MB, ~8 ms to read

    def __init__(self) -> None:
        self.entries: dict[str, list[str]] | None = None
        self.used: set[str] = set()
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
        if not isinstance(hit, list):
            return None
        self.used.add(key)
        return frozenset(hit)

    def put(self, key: str, names: frozenset[str]) -> None:
        if self.entries is None:
            self.entries = {}
        if len(self.entries) >= self.MAX_ENTRIES:
            kept = {k: v for k, v in self.entries.items() if k in self.used}
            self.entries = kept if len(kept) < self.MAX_ENTRIES else {}
        self.entries[key] = sorted(names)
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
    """What one pass over several closures learns once: {file: (sha256, imports)}, {module name: file or None} and
    {file: the followed files it imports} (files as absolute path strings). Only for a pass that ends before any file
    can change (registry.stages()); a new pass starts empty."""

    def __init__(self) -> None:
        self.files: dict[str, tuple[str, frozenset[str]]] = {}
        self.modules: dict[str, str | None] = {}
        self.edges: dict[str, tuple[str, ...]] = {}


def _rel(path: str, root: str) -> str:
    return path[len(root) + 1:] if path.startswith(root + os.sep) else str(Path(path).relative_to(root))


def _read(path: str, root: str, reads: Reads) -> tuple[str, frozenset[str]]:
    """(sha256 of the bytes, dotted names under FOLLOWED the file imports, anywhere in it); `from a import b` yields
    `a` and `a.b` (b may be a module)."""
    if (hit := reads.files.get(path)) is not None:
        return hit
    with open(path, "rb") as fh:
        data = fh.read()
    sha = hashlib.sha256(data).hexdigest()
    key = f"{_rel(path, root)}:{sha}"
    names = _CACHE.get(key)
    if names is None:
        names = _parse_imports(data, Path(path), Path(root))
        _CACHE.put(key, names)
    reads.files[path] = (sha, names)
    return sha, names


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
    return frozenset(n for n in out if _followed(n))


def _module_file(name: str, root: str, reads: Reads) -> str | None:
    if name not in reads.modules:
        f = module_file(name, root)
        reads.modules[name] = None if f is None else str(f)
    return reads.modules[name]


def _reached(path: str, root: str, reads: Reads) -> tuple[str, ...]:
    """Files under FOLLOWED that `path` imports directly. A package reached through `a.b.c` brings its `__init__.py`
    files too (importing a.b.c runs them)."""
    if (hit := reads.edges.get(path)) is not None:
        return hit
    prefixes: set[str] = set()
    for name in _read(path, root, reads)[1]:
        if _followed(name):
            parts = name.split(".")
            prefixes.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    out = {f: None for p in sorted(prefixes) if _followed(p) and (f := _module_file(p, root, reads)) is not None}
    reads.edges[path] = tuple(out)
    return reads.edges[path]


def _walk(start: Path, root: Path, reads: Reads) -> dict[str, str]:
    """{file: sha256} for `start` and every file under FOLLOWED it reaches through imports, transitively."""
    first, top = str(start), str(root)
    seen: dict[str, None] = {first: None}
    todo = [first]
    while todo:
        for f in _reached(todo.pop(), top, reads):
            if f not in seen:
                seen[f] = None
                todo.append(f)
    _CACHE.flush()
    return {p: _read(p, top, reads)[0] for p in seen}


def _in_order(start: Path, files) -> list[str]:
    """`start` first, then the others in the order of their path parts (how sorted() orders Paths)."""
    first = str(start)
    return [first, *sorted((f for f in files if f != first), key=lambda f: f.split(os.sep))]


def closure(start: Path, root: Path = REPO, reads: Reads | None = None) -> list[Path]:
    """`start` and every file under FOLLOWED it reaches through imports, transitively; sorted, `start` first."""
    return [Path(f) for f in _in_order(start, _walk(start, root, reads or Reads()))]


def code_digests(start: Path, root: Path = REPO, reads: Reads | None = None) -> dict[str, str]:
    """{path relative to root: sha256 of its bytes} for the closure of `start`: what enters a stage's fingerprint.
    `reads`: shared by the closures of one pass (each file read once); a fresh one when not given."""
    shas = _walk(start, root, reads or Reads())
    top = str(root)
    return {_rel(f, top): shas[f][:16] for f in _in_order(start, shas)}


def changed_files(old: object, new: dict[str, str]) -> list[str]:
    """Files whose digest differs between two `code_digests` results (added and removed files included); empty when
    `old` is not such a dict (an artifact committed before code was recorded per file)."""
    if not isinstance(old, dict):
        return []
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
