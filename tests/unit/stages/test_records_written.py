"""No stage writes an artifact dict literal: every JSON document a stage module writes (`<path>.write_text(
json.dumps(X, ...))`) is a record's `to_json()` (runtime/records*.py), directly or through a name bound to one in the
same function, so each contract's schema is spelled once, in its record. The files below are the exceptions, each
with why it has no record yet."""
from __future__ import annotations

import ast
from pathlib import Path

from support import REPO

NOT_RECORDS = {    # file name -> why it is written without a record (no other stage reads it)
    "stats.json": "data's statistics, read by its own report only",
    "quality.json": "quantize's measurements, read by its own report only",
    "curve.json": "train_draft's training curve, read by its own report only",
    "checks.json": "train_draft's export checks, read by its own report only",
    "prompt_format.json": "runtime/serving/prompt_format.py's client-facing description, written as it builds it",
    "specpipe_model.json": "the Triton CPU model's settings, read by runtime/serving/triton_model/model.py",
}


def _is_to_json(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "to_json"


def _is_dumps(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "dumps"
            and bool(node.args))


def _assignments(fn: ast.AST) -> dict[str, list[ast.AST]]:
    """name -> every value a function assigns to it."""
    out: dict[str, list[ast.AST]] = {}
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    out.setdefault(t.id, []).append(node.value)
    return out


def _file_names(node: ast.AST) -> set[str]:
    return {c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)}


def dict_writes(path: Path, root: Path = REPO) -> list[str]:
    """`file:line` of every JSON write in `path` whose document is not a record's `to_json()` (nor an exception)."""
    tree = ast.parse(path.read_text())
    out = []
    for fn in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
        assigned = _assignments(fn)
        for call in ast.walk(fn):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "write_text"
                    and call.args):
                continue
            text = call.args[0]      # json.dumps(...), or a name bound to it (`text = json.dumps(doc)`)
            dumps = [text] if _is_dumps(text) else [v for v in assigned.get(getattr(text, "id", ""), []) if _is_dumps(v)]
            docs = [d.args[0] for d in dumps]
            if all(_is_to_json(d) or (isinstance(d, ast.Name) and assigned.get(d.id)
                                      and all(_is_to_json(v) for v in assigned[d.id])) for d in docs):
                continue
            if _file_names(call.func.value) & set(NOT_RECORDS):
                continue
            out.append(f"{path.relative_to(root)}:{call.lineno}")
    return out


def test_no_stage_writes_an_artifact_dict_literal():
    bad = [w for f in sorted((REPO / "stages").glob("*.py")) for w in dict_writes(f)]
    assert bad == [], ("these stage writes build the JSON document by hand; build the artifact's record "
                       f"(runtime/records*.py) and write its to_json(): {bad}")


def test_the_rule_sees_a_dict_literal_and_a_name_bound_to_one(tmp_path):
    f = tmp_path / "probe.py"
    f.write_text("import json\n\n"
                 "def run(ctx, info):\n"
                 "    (ctx.out_dir / 'a.json').write_text(json.dumps({'k': 1}))\n"
                 "    doc = {'k': 2}\n"
                 "    (ctx.out_dir / 'b.json').write_text(json.dumps(doc, indent=2))\n"
                 "    good = info.to_json()\n"
                 "    (ctx.out_dir / 'c.json').write_text(json.dumps(good))\n"
                 "    (ctx.out_dir / 'd.json').write_text(json.dumps(info.to_json(), indent=2))\n"
                 "    (ctx.out_dir / 'stats.json').write_text(json.dumps({'n': 1}))\n"
                 "    text = json.dumps(doc)\n"
                 "    (ctx.out_dir / 'e.json').write_text(text)\n"
                 "    (ctx.out_dir / 'README.md').write_text('not JSON')\n")
    assert dict_writes(f, tmp_path) == ["probe.py:4", "probe.py:6", "probe.py:12"]
