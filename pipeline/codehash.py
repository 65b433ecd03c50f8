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
directory; a file edited is a new key, a cache that cannot be read or written is ignored).
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


def _followed(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in FOLLOWED)


def module_file(name: str, root: Path = REPO) -> Path | None:
    """The source file of a dotted module name under `root` (a module or a package's __init__), or None."""
    base = root.joinpath(*name.split("."))
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.is_file():
            return cand
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


def _imports(path: Path, root: Path) -> frozenset[str]:
    """Dotted names `path` imports, anywhere in the file; `from a import b` yields `a` and `a.b` (b may be a module)."""
    data = path.read_bytes()
    key = f"{path.relative_to(root)}:{hashlib.sha256(data).hexdigest()}"
    hit = _CACHE.get(key)
    if hit is None:
        hit = _parse_imports(data, path, root)
        _CACHE.put(key, hit)
    return hit


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


def closure(start: Path, root: Path = REPO) -> list[Path]:
    """`start` and every file under FOLLOWED it reaches through imports, transitively; sorted, `start` first.
    A package reached through `a.b.c` brings its `__init__.py` files too (importing a.b.c runs them)."""
    seen: dict[Path, None] = {start: None}
    files: dict[str, Path | None] = {}
    todo = [start]
    while todo:
        for name in sorted(_imports(todo.pop(), root)):
            if not _followed(name):
                continue
            parts = name.split(".")
            for i in range(1, len(parts) + 1):
                if not _followed(prefix := ".".join(parts[:i])):
                    continue
                if prefix not in files:
                    files[prefix] = module_file(prefix, root)
                f = files[prefix]
                if f is not None and f not in seen:
                    seen[f] = None
                    todo.append(f)
    _CACHE.flush()
    return [start, *sorted(p for p in seen if p != start)]


def code_digests(start: Path, root: Path = REPO) -> dict[str, str]:
    """{path relative to root: sha256 of its bytes} for the closure of `start`: what enters a stage's fingerprint."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()[:16] for p in closure(start, root)}


def changed_files(old: object, new: dict[str, str]) -> list[str]:
    """Files whose digest differs between two `code_digests` results (added and removed files included); empty when
    `old` is not such a dict (an artifact committed before code was recorded per file)."""
    if not isinstance(old, dict):
        return []
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
