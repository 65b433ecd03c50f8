"""Why the acceptance dropped: the diagnosis `specpipe monitor` prints beside an alarm, from three signals.

- the canary: the validated prompts, probed every round (active mode), one CUSUM per domain;
- the traffic: the engine's own counters between two rounds, the canary's requests left out, one CUSUM (overall);
- what is served: the model directories the endpoint serves, hashed (config.json, tokenizer files, weights) and
  compared with the identity export recorded for the exported pair (export.json `served_identity`).

Verdicts (docs/serving.md, "Why it dropped"):
- target changed: the served target differs from the export (the evidence names the files), whatever the CUSUMs say
  -> rebuild (`specpipe build`) on what is now served, or redeploy the exported pair;
- draft changed: only the served draft differs -> redeploy the exported draft;
- engine state: the canary and the traffic both dropped on unchanged files (one alarmed, the other alarmed or is below
  its alarm boundary) -> restart the engine first (acceptance
  decay over hours of serving is the common report: vllm-project/vllm#41838, sgl-project/sglang#28771, #37326),
  rebuild only if a fresh instance shows the drop too;
- traffic drift: the canary holds, the traffic dropped -> the users' prompts moved away from the validated domains:
  retrain the draft on current traffic; the report names the canary's per-domain ALs, all within their band;
- canary only: the canary dropped, the traffic holds -> check the probe path (prompt format, sampling), then restart;
- unknown: an alarm with one signal missing (no canary, or no traffic counters): the verdict says which to add.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "vocab.json", "merges.txt")
TRAFFIC = "traffic"     # the live traffic's test beside the canary's domains (active mode with --traffic)
CAUSES = ("target_changed", "draft_changed", "engine_state", "traffic_drift", "canary_only", "unknown")


def _sha(paths: list[Path]) -> str | None:
    if not paths:
        return None
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode() + b"\0")
        with open(p, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


def model_identity(d: Path, cache: dict | None = None) -> dict[str, str | None]:
    """sha256 of a model directory's config.json, tokenizer files and weights (*.safetensors, sorted). `cache`
    (path -> [size, mtime_ns, identity]) saves re-hashing unchanged weights every round."""
    d = Path(d)
    if not d.is_dir():
        raise FileNotFoundError(f"{d}: not a directory")
    weights = sorted(d.glob("*.safetensors"))
    stamp = [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(d.iterdir()) if p.is_file()]
    key = os.fspath(d.resolve())
    if cache is not None and key in cache and cache[key][0] == stamp:
        return cache[key][1]
    ident = {"config": _sha([d / "config.json"] if (d / "config.json").is_file() else []),
             "tokenizer": _sha([d / n for n in TOKENIZER_FILES if (d / n).is_file()]),
             "weights": _sha(weights)}
    if cache is not None:
        cache[key] = [stamp, ident]
    return ident


def served_identity(target_dir, drafts: dict) -> dict:
    """export.json's `served_identity`: model_identity of the exported target and of each other exported model
    (role -> directory; None: not exported; "target_bf16", "draft_cpu": variants a served target or draft may match),
    which `specpipe monitor --served-target/--served-draft` compares with what is served."""
    out = {"target": model_identity(Path(target_dir))}
    out.update({role: model_identity(Path(d)) for role, d in drafts.items() if d})
    return out


def compare_identity(role: str, expected: dict | None, served: dict | None) -> list[str]:
    """Evidence lines for each part of `role`'s served identity that differs from the exported one."""
    if not expected or not served:
        return []
    return [f"{role} {part} sha256 {str(served.get(part))[:12]} != exported {str(expected.get(part))[:12]}"
            for part in ("config", "tokenizer", "weights") if expected.get(part) != served.get(part)]


@dataclass
class Verdict:
    cause: str                    # one of CAUSES
    action: str
    evidence: list[str] = field(default_factory=list)

    def line(self) -> str:
        return f"diagnosis: {self.cause.replace('_', ' ')} ({'; '.join(self.evidence)}); action: {self.action}"

    def to_json(self) -> dict:
        return asdict(self)


def _fmt(t) -> str:
    live = t.live_al
    return f"{t.domain} AL {live:.3f} vs {t.al0:.3f}" if live is not None else f"{t.domain}: no observation"


def _down(t) -> bool:
    """An alarm, or a live AL below the test's alarm boundary: the second signal counts as down without waiting for its
    own CUSUM, so the verdict is right in the round the first alarm comes."""
    return t.alarm or (t.live_al is not None and t.live_al < (t.al0 + t.al1) / 2)


def diagnose(canary: dict, traffic, changed: list[str]) -> Verdict | None:
    """The verdict for this round, or None when nothing alarms and nothing served changed. `canary`: the per-domain
    DomainTests of the active probes ({} when not probed); `traffic`: the traffic DomainTest or None; `changed`:
    compare_identity's evidence."""
    canary_alarm = [t for t in canary.values() if t.alarm]
    traffic_alarm = traffic is not None and traffic.alarm
    if changed:
        target = any(not e.startswith("draft") for e in changed)
        cause = "target_changed" if target else "draft_changed"
        what = "target" if target else "draft"
        if canary_alarm or traffic_alarm:
            ev = changed + [f"canary alarm: {_fmt(t)}" for t in canary_alarm] + ([f"traffic {_fmt(traffic)}"]
                                                                             if traffic_alarm else [])
            act = ("rebuild: the served target is not the exported one (run `specpipe build` on the served target, or "
                   "redeploy the exported files)" if target else
                   "redeploy the exported draft: the served draft is not the validated one (or rebuild if a new draft "
                   "was meant)")
            return Verdict(cause, act, ev)
        return Verdict(cause, f"no acceptance drop yet, but the served {what} is not the exported one: redeploy the "
                       "exported files or rebuild on the served ones", changed)
    if not canary_alarm and not traffic_alarm:
        return None
    held = [_fmt(t) for t in canary.values() if not _down(t)]
    canary_down = [t for t in canary.values() if _down(t)]
    traffic_down = traffic is not None and _down(traffic)
    if (canary_alarm and traffic_down) or (traffic_alarm and canary_down):
        return Verdict("engine_state", "restart the engine first (the served files are the exported ones); rebuild only "
                       "if a fresh instance shows the drop too",
                       [f"canary {'alarm' if t.alarm else 'below band'}: {_fmt(t)}" for t in canary_down]
                       + [f"traffic {'alarm' if traffic_alarm else 'below band'}: {_fmt(traffic)}", "served files unchanged"])
    if traffic_alarm and canary:
        return Verdict("traffic_drift", "retrain the draft on current traffic (the validated domains still accept as "
                       "validated)", [f"traffic alarm: {_fmt(traffic)}"] + [f"canary holds: {h}" for h in held])
    if canary_alarm and traffic is not None:
        return Verdict("canary_only", "check the probe path (prompt format, sampling), then restart the engine",
                       [f"canary alarm: {_fmt(t)}" for t in canary_alarm] + [f"traffic holds: {_fmt(traffic)}"])
    missing = "no canary (add --url to probe the validated prompts)" if not canary else \
        "no traffic counters (add --metrics-url to read the engine's counters)"
    alarms = [f"canary alarm: {_fmt(t)}" for t in canary_alarm] + ([f"traffic alarm: {_fmt(traffic)}"] if traffic_alarm
                                                                   else [])
    return Verdict("unknown", f"cannot tell engine state from traffic drift: {missing}; restart first if in doubt",
                   alarms)


def diagnose_round(mon) -> None:
    """A monitor round's diagnosis (pipeline.monitor.Monitor `mon`): the served directories compared with the export's
    identity (mon.changed), then the verdict from the canary's and the traffic's tests (mon.verdict)."""
    mon.changed = []
    expected = mon.run.served_identity or {}
    for role, d in mon.served.items():
        try:
            ident = model_identity(Path(d), mon.identity_cache)
        except OSError as e:
            mon.changed.append(f"{role}: cannot read the served directory ({e})")
            continue
        if role not in expected:
            mon.echo(f"round {mon.round} note: export.json records no {role} identity (an export before it): "
                     "rerun `specpipe build` to compare what is served")
        # a draft matches any of the exported drafts (TensorRT-LLM's, the CPU model's, the speculators one)
        diffs = [compare_identity(role, c, ident) for k, c in expected.items() if k == role or k.startswith(role + "_")]
        if diffs and all(diffs):              # the evidence against the closest exported variant
            mon.changed += min(diffs, key=len)
    if mon.passive:
        canary, traffic = {}, mon.tests.get("overall")
    else:
        canary = {d: t for d, t in mon.tests.items() if d != TRAFFIC}
        traffic = mon.tests.get(TRAFFIC)
    mon.verdict = diagnose(canary, traffic, mon.changed)
