"""The code a stage's output depends on: its module and every project module it reaches by import.

A stage keeps its contract and orchestration; the logic it runs lives in `runtime/` (and what it reads of other
stages in `pipeline/artifacts/`). Hashing the stage module alone would let an edit of `runtime/quant/checks.py`
leave a committed quantize artifact looking current. So a stage's code is the closure of its static imports
(module level and inside functions, where heavy imports live) over the packages in `FOLLOWED`, each file hashed
on its own: the fingerprint holds {relative path: sha256}, and `plan` can say which file changed.

Only `runtime/` and `pipeline/artifacts/` are followed: they decide what a stage produces. The rest of `pipeline/`
(logging, reports, the runner itself) does not, and following it would re-run a two-hour training for an edit of
a progress bar.
"""
from __future__ import annotations

import ast
import hashlib
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


def _imports(path: Path, root: Path) -> set[str]:
    """Dotted names `path` imports, anywhere in the file; `from a import b` yields `a` and `a.b` (b may be a module)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
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
    return out


def closure(start: Path, root: Path = REPO) -> list[Path]:
    """`start` and every file under FOLLOWED it reaches through imports, transitively; sorted, `start` first.
    A package reached through `a.b.c` brings its `__init__.py` files too (importing a.b.c runs them)."""
    seen: dict[Path, None] = {start: None}
    todo = [start]
    while todo:
        for name in sorted(_imports(todo.pop(), root)):
            if not _followed(name):
                continue
            parts = name.split(".")
            for i in range(1, len(parts) + 1):
                if not _followed(prefix := ".".join(parts[:i])):
                    continue
                f = module_file(prefix, root)
                if f is not None and f not in seen:
                    seen[f] = None
                    todo.append(f)
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
