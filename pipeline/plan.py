"""The plan: each stage's fingerprint (what it hashes), whether its committed artifact is current, and why it reruns
(`stale_reason`, down to the code file and the import chain by which the stage reaches it), with `--only`, `--from`,
`--force` and `--keep` (pipeline/keep.py). Nothing here runs a stage or writes a file: runner.build does."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cache
from importlib import metadata
from pathlib import Path

from pipeline import codehash, keep, registry
from pipeline.config import section_dict
from pipeline.device import plan_device_type
from pipeline.errors import UsageError
from pipeline.store import Store


@cache
def package_version(name: str) -> str | None:
    """`importlib.metadata.version(name)`, read from the `Version:` header without parsing the whole METADATA file
    (a package's README often follows it: ~0.4 ms a package, on every plan)."""
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None
    for line in (dist.read_text("METADATA") or dist.read_text("PKG-INFO") or "").splitlines():
        if not line:        # the headers end at the first empty line
            break
        if line.startswith("Version:"):
            return line[len("Version:"):].strip()
    return dist.version


def fingerprint_inputs(spec: registry.StageSpec, cfg, upstream: dict[str, str]) -> dict:
    """What a stage's fingerprint hashes: its section (less EXECUTION_ONLY), code, inputs, packages, external files,
    and what the section resolves to on this machine (`resolved`: auto dtypes, only in the stages whose artifact
    they change)."""
    params = section_dict(cfg, spec.name)
    params.pop("enabled", None)
    # Where and how a stage executes (e.g. a rendezvous host, this node's rank) does not change what it
    # produces: a stage lists such dotted paths in EXECUTION_ONLY and they stay out of its fingerprint.
    for dotted in getattr(spec.module, "EXECUTION_ONLY", ()):
        *parents, leaf = dotted.split(".")
        node = params
        for p in parents:
            node = node.get(p, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node.pop(leaf, None)
    doc = {
        "stage": spec.name,
        "version": spec.version,
        "code": spec.code,
        "params": params,
        "uses": {u: section_dict(cfg, u) for u in spec.uses},
        "inputs": {d: upstream[d] for d in spec.consumes},
        "packages": {p: package_version(p) for p in spec.packages},
    }
    if spec.fingerprint_extra is not None:
        doc["external"] = spec.fingerprint_extra(getattr(cfg, spec.name))
    if spec.resolved is not None:
        doc["resolved"] = spec.resolved(getattr(cfg, spec.name), lambda: plan_device_type(cfg.run))
    # A measured hardware profile (`hardware.profile`) is an input of the stages that use `hardware`: its
    # content, not only its path, decides their output.
    prof = cfg.hardware.profile if "hardware" in spec.uses else None
    if prof is not None and Path(prof).is_file():
        doc["hardware_profile"] = hashlib.sha256(Path(prof).read_bytes()).hexdigest()
    return doc


def fingerprint(doc: dict) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def _diff_paths(old, new, prefix: str) -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new), key=str):
            out += _diff_paths(old.get(k, "<absent>"), new.get(k, "<absent>"), f"{prefix}.{k}" if prefix else str(k))
        return out
    return [] if old == new else [prefix]


def _code_reason(old: object, new: dict[str, str]) -> str:
    """"code changed: <files>", the files only re-digested (same bytes) counted apart."""
    files = codehash.changed_files(old, new)
    same = codehash.same_bytes(old, files, new)
    real = [f for f in files if f not in same]
    out = "code changed" + (": " + ", ".join(real[:4]) + (f" (+{len(real) - 4} more)" if len(real) > 4 else "") if real else "")
    return out + (f"{'; ' if real else ': '}{len(same)} file(s) of the same bytes, digest now of the AST" if same else "")


def stale_reason(old_doc: dict | None, new_doc: dict) -> str:
    """Why a committed artifact with `old_doc` does not match `new_doc`; cheapest, most useful first."""
    if old_doc is None:
        return "no artifact"
    reasons = []
    if p := _diff_paths(old_doc.get("params", {}), new_doc["params"], new_doc["stage"]):
        reasons.append("params changed: " + ", ".join(p))
    if p := _diff_paths(old_doc.get("uses", {}), new_doc["uses"], ""):
        reasons.append("params changed: " + ", ".join(p))
    if changed := [d for d in new_doc["inputs"] if old_doc.get("inputs", {}).get(d) != new_doc["inputs"][d]]:
        reasons.append("input changed: " + ", ".join(changed))
    if old_doc.get("version") != new_doc["version"]:
        reasons.append(f"code changed: VERSION {old_doc.get('version')} -> {new_doc['version']}")
    elif old_doc.get("code") != new_doc["code"]:
        reasons.append(_code_reason(old_doc.get("code"), new_doc["code"]))
    if p := [k for k in new_doc["packages"] if old_doc.get("packages", {}).get(k) != new_doc["packages"][k]]:
        reasons.append("packages changed: " + ", ".join(
            f"{k} {old_doc.get('packages', {}).get(k)} -> {new_doc['packages'][k]}" for k in p))
    if old_doc.get("hardware_profile") != new_doc.get("hardware_profile"):
        reasons.append("hardware.profile content changed")
    if old_doc.get("resolved", {}) != new_doc.get("resolved", {}):
        old_r, new_r = old_doc.get("resolved") or {}, new_doc.get("resolved") or {}
        reasons.append("resolved on this machine differently: " + ", ".join(
            f"{new_doc['stage']}.{k} {old_r.get(k, '<absent>')} -> {new_r.get(k, '<absent>')}"
            for k in _diff_paths(old_r, new_r, "")))
    if old_doc.get("external") != new_doc.get("external"):
        reasons.append("external input changed: " + ", ".join(_diff_paths(old_doc.get("external"), new_doc.get("external"), "")) )
    return "; ".join(reasons) or "fingerprint changed"


# ------------------------------------------------------------------ plan


@dataclass
class PlanItem:
    name: str
    action: str            # run | skip | keep | disabled | excluded
    reason: str
    fingerprint: str       # the committed artifact's own where it is current (kept or not), else the planned one
    doc: dict = field(repr=False, default_factory=dict)
    code_changes: list[dict] = field(default_factory=list)   # [{"file", "via": [stage module, ..., file]}]
    only_code: bool = False    # stale, and only its code differs: `--keep` would accept it
    keep_from: dict | None = field(repr=False, default=None)  # action keep: the fingerprint inputs it was accepted under
    planned: str = ""      # the fingerprint of this config and code (differs from `fingerprint` for a kept artifact)


def code_changes(spec: registry.StageSpec, old_doc: dict | None, new_doc: dict) -> list[dict]:
    """Each code file that differs, with the shortest import chain from the stage module to it (empty `via`: the
    file is no longer reached)."""
    old = (old_doc or {}).get("code")
    files = codehash.changed_files(old, new_doc["code"])
    files = [f for f in files if f not in codehash.same_bytes(old, files, new_doc["code"])]
    if not files:
        return []
    chains = codehash.chains(spec.file, exclude=spec.execution_only_code)
    return [{"file": f, "via": chains.get(f, [])} for f in files]


def _validate_names(names: list[str], only, from_, force, keep_: tuple[str, ...]) -> None:
    for opt, val in (("--only", only), ("--from", from_)):
        if val is not None and val not in names:
            raise UsageError(f"{opt} {val}: unknown stage; stages are: {', '.join(names)}")
    for f in force:
        if f != "all" and f not in names:
            raise UsageError(f"--force {f}: unknown stage; use 'all' or one of: {', '.join(names)}")
    for k in keep_:
        if k not in names:
            raise UsageError(f"--keep {k}: unknown stage; stages are: {', '.join(names)}")
        if k in force or "all" in force:
            raise UsageError(f"--keep {k} and --force {k if k in force else 'all'} contradict each other")


def _kept(spec, m: dict | None, doc: dict, fp: str, store: Store) -> PlanItem:
    """The plan item of `--keep <stage>` for a stale stage, or UsageError saying why it cannot be kept."""
    if m is None:
        raise UsageError(f"--keep {spec.name}: nothing committed to keep; it must run")
    old = keep.latest_doc(m)
    why = keep.refusal(spec.name, old, doc, stale_reason)
    if why:
        raise UsageError(why)
    keep.check_readable(spec.name, store.artifacts / spec.name)
    changes = code_changes(spec, old, doc)
    reason = "kept across a code change (--keep): " + ", ".join(c["file"] for c in changes[:4]) + \
        (f" (+{len(changes) - 4} more)" if len(changes) > 4 else "")
    return PlanItem(spec.name, "keep", reason, m["fingerprint"], doc, changes, keep_from=old, planned=fp)


def _item(spec, cfg, store: Store, doc: dict, fp: str, sel: dict) -> PlanItem:
    """One stage's plan item (`sel`: only, start index, index, forced, keep)."""
    if not getattr(cfg, spec.name).enabled:
        return PlanItem(spec.name, "disabled", "disabled in config", fp, doc, planned=fp)
    m = store.manifest(spec.name)
    current = m is not None and any(f == fp for f, _ in keep.accepted(m))
    ident = m["fingerprint"] if current else fp
    old = keep.latest_doc(m) if m else None
    if spec.name in sel["keep"] and not current:
        return _kept(spec, m, doc, fp, store)
    excluded = (sel["only"] is not None and spec.name != sel["only"]) or sel["i"] < sel["start"]
    only_code = m is not None and not current and keep.refusal(spec.name, old, doc, stale_reason) is None
    if excluded:
        state = "up to date" if current else ("not committed" if m is None else "stale")
        changes = [] if current or m is None else code_changes(spec, old, doc)
        if state == "stale":
            state += ": " + stale_reason(old, doc)
        return PlanItem(spec.name, "excluded", f"not selected ({state})", ident, doc, changes, only_code, planned=fp)
    if spec.name in sel["forced"]:
        return PlanItem(spec.name, "run", "forced", fp, doc, planned=fp)
    if current:
        return PlanItem(spec.name, "skip", "up to date" + (" (kept)" if ident != fp else ""), ident, doc, planned=fp)
    return PlanItem(spec.name, "run", stale_reason(old, doc), fp, doc, code_changes(spec, old, doc) if m else [],
                    only_code, planned=fp)


def make_plan(cfg, store: Store, only: str | None = None, from_: str | None = None,
              force: tuple[str, ...] = (), keep_: tuple[str, ...] = ()) -> list[PlanItem]:
    """What `build` would do to each stage, and why. A committed artifact is current when the planned fingerprint
    is the one it was produced under or one it was kept under (`--keep`, pipeline/keep.py); the stages that
    consume it then hash its own fingerprint, so a keep never reruns them."""
    names = registry.names()
    _validate_names(names, only, from_, force, keep_)
    sel = {"only": only, "start": names.index(from_) if from_ else 0, "forced": set(names) if "all" in force else set(force),
           "keep": set(keep_)}
    upstream: dict[str, str] = {}
    plan: list[PlanItem] = []
    for i, spec in enumerate(registry.stages()):
        doc = fingerprint_inputs(spec, cfg, upstream)
        fp = fingerprint(doc)
        item = _item(spec, cfg, store, doc, fp, {**sel, "i": i})
        upstream[spec.name] = item.fingerprint if item.action in ("skip", "keep", "excluded") else fp
        plan.append(item)
    _check_inputs(plan, store)
    return plan


def _check_inputs(plan: list[PlanItem], store: Store) -> None:
    """A stage that runs needs each input committed with the fingerprint it was planned with."""
    by_name = {p.name: p for p in plan}
    for p in plan:
        if p.action != "run":
            continue
        for dep in registry.get(p.name).consumes:
            d = by_name[dep]
            if d.action in ("run", "skip", "keep"):
                continue
            m = store.manifest(dep)
            if m is None or m["fingerprint"] != d.fingerprint:
                hint = (f"; or, if its committed artifact should stay (only its code changed), keep it: --keep {dep}"
                        if d.only_code else "")
                state = d.reason[len("not selected ("):-1] if d.reason.startswith("not selected (") else d.reason
                raise UsageError(
                    f"stage '{p.name}' needs '{dep}' up to date, but it is {state}; "
                    f"run `specpipe build` without --only/--from, or with --from {dep}{hint}")
