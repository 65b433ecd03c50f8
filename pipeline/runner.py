"""Stage runner: execution of the plan (pipeline/plan.py: fingerprints, what runs and why) with atomic commit,
provenance, the keeps `--keep` asks for (pipeline/keep.py), and `status`."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import shutil
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path

from pipeline import keep, registry
from pipeline.config import section_dict
from pipeline.device import ResolvedDevice, resolve_device
from pipeline.errors import StageError

# the plan's names, used here and read as runner.<name> by callers that predate pipeline/plan.py
from pipeline.plan import PlanItem, fingerprint, fingerprint_inputs, make_plan, package_version, stale_reason  # noqa: F401
from pipeline.stage import StageContext
from pipeline.store import Store, atomic_write_text, fault_point
from runtime.errors import RuntimeFailure

log = logging.getLogger("specpipe")


# ------------------------------------------------------------------ provenance helpers


@lru_cache(maxsize=1)
def git_commit() -> str | None:
    import subprocess  # here, not at the top: a no-op build never runs git

    here = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        if out.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


class PeakMemory:
    """Samples RSS of this process and its children (e.g. torchrun workers) while a stage runs."""

    def __init__(self, interval: float = 0.2):
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)

    def _sample(self) -> None:
        import psutil

        p = psutil.Process()
        try:
            rss = p.memory_info().rss + sum(c.memory_info().rss for c in p.children(recursive=True))
        except psutil.Error:
            return
        self.peak = max(self.peak, rss)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self):
        self._sample()
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self._sample()


# ------------------------------------------------------------------ execution


@dataclass
class Outcome:
    name: str
    action: str
    reason: str
    fingerprint: str
    wall_s: float = 0.0
    error: str | None = None
    log_file: str | None = None
    failed_metrics: dict | None = None


def _stage_logger(store: Store, name: str) -> tuple[logging.Logger, logging.Handler]:
    store.logs.mkdir(parents=True, exist_ok=True)
    lg = logging.getLogger(f"specpipe.{name}")
    fh = logging.FileHandler(store.logs / f"{name}.log")
    fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    lg.addHandler(fh)
    return lg, fh


def _apply_run_settings(cfg) -> None:
    if cfg.run.threads:
        os.environ.setdefault("OMP_NUM_THREADS", str(cfg.run.threads))
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(cfg.run.threads)


def _committed_inputs(spec, item: PlanItem, store: Store) -> dict:
    """The committed artifact of every stage `spec` consumes, each the one the plan fingerprinted."""
    inputs = {}
    for d in spec.consumes:
        a = store.artifact(d)
        assert a is not None and a.fingerprint == item.doc["inputs"][d], f"input {d} not committed"
        inputs[d] = a
    return inputs


def _manifest(item: PlanItem, ctx: StageContext, spec, argv: list[str], metrics: dict, started: datetime, wall: float,
              peak: int) -> dict:
    """manifest.json of a stage that ran (`ctx`: its context, with the config and the inputs): its fingerprint and
    what went into it, the metrics, and the provenance."""
    cfg, inputs = ctx.config, ctx.inputs
    return {
        "stage": spec.name,
        "fingerprint": item.fingerprint,
        "fingerprint_inputs": item.doc,
        "metrics": metrics,
        "provenance": {
            "config": section_dict(cfg, spec.name),
            "uses": {u: section_dict(cfg, u) for u in spec.uses},
            "command": shlex.join(argv),
            "specpipe_version": package_version("specpipe"),
            "git_commit": git_commit(),
            "packages": item.doc["packages"],
            "python": sys.version.split()[0],
            "host": socket.gethostname(),
            "started": started.isoformat(timespec="seconds"),
            "wall_time_s": round(wall, 3),
            "peak_rss_mb": round(peak / 2**20, 1),
            "inputs": {d: {"fingerprint": a.fingerprint, "digest": a.manifest.get("digest")} for d, a in inputs.items()},
        },
    }


def _failed(e: BaseException, lg: logging.Logger) -> tuple[str, dict | None]:
    """A failed stage's error message and the metrics its StageError/RuntimeFailure carried, logged: expected failures
    by their message, anything else with its traceback."""
    failed_metrics = None
    if isinstance(e, (StageError, RuntimeFailure)):   # the runtime's own expected failures read like a stage's
        lg.error("%s", e)
        msg = str(e)
        failed_metrics = getattr(e, "metrics", None) or None
    else:
        lg.error("unexpected error:\n%s", traceback.format_exc())
        msg = f"{type(e).__name__}: {e}"
    return msg, failed_metrics


def run_stage(item: PlanItem, cfg, store: Store, argv: list[str], device: ResolvedDevice) -> Outcome:
    spec = registry.get(item.name)
    lg, fh = _stage_logger(store, spec.name)
    tmp = store.new_tmp(spec.name)
    inputs = _committed_inputs(spec, item, store)
    ctx = StageContext(
        name=spec.name, config=cfg, section=getattr(cfg, spec.name), out_dir=tmp,
        scratch_dir=store.scratch_dir(spec.name, item.fingerprint), inputs=inputs, workdir=store.root,
        fingerprint=item.fingerprint, log=lg, device=device,
    )
    started = datetime.now(timezone.utc)
    t0 = time.monotonic()
    log_file = str(store.logs / f"{spec.name}.log")
    try:
        _apply_run_settings(cfg)
        with PeakMemory() as mem:
            metrics = spec.module.run(ctx) or {}
        fault_point(spec.name, "after-run")
        wall = time.monotonic() - t0
        manifest = _manifest(item, ctx, spec, argv, metrics, started, wall, mem.peak)
        manifest["provenance"]["device"] = device.type   # run.device as resolved (never fingerprinted)
        store.commit(spec.name, tmp, manifest)
        lg.info("committed in %.1fs (peak RSS %.0f MB)", wall, mem.peak / 2**20)
        return Outcome(spec.name, "ran", item.reason, item.fingerprint, wall, log_file=log_file)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        wall = time.monotonic() - t0
        if isinstance(e, KeyboardInterrupt):
            lg.error("interrupted after %.1fs; nothing committed", wall)
            raise
        msg, failed_metrics = _failed(e, lg)
        return Outcome(spec.name, "failed", item.reason, item.fingerprint, wall, error=msg, log_file=log_file,
                       failed_metrics=failed_metrics)
    finally:
        lg.removeHandler(fh)
        fh.close()


def _record_keep(item: PlanItem, store: Store, argv: list[str]) -> Outcome:
    """Write a `--keep` into the artifact's manifest (the keep, its code changes, when, who, the command), logged."""
    entry = keep.record(item.keep_from or {}, item.doc, item.planned, argv)
    store.record_keep(item.name, entry)
    log.warning("[%s] %s", item.name, keep.describe(entry))
    return Outcome(item.name, "kept", item.reason, item.fingerprint)


def build(cfg, store: Store, *, argv: list[str], config_path: str, only=None, from_=None, force=(),
          keep_=()) -> list[Outcome]:
    """Run the plan under the workdir lock. Returns one Outcome per stage, stopping at the first failure."""
    store.lock()
    try:
        removed = store.clean_tmp()
        if removed:
            log.info("removed leftovers of an interrupted run: %s", ", ".join(removed))
        plan = make_plan(cfg, store, only=only, from_=from_, force=force, keep_=tuple(keep_))
        # the keeps first, before any stage runs: a later failure leaves them recorded
        kept = {i.name: _record_keep(i, store, argv) for i in plan if i.action == "keep"}
        # run.device, resolved once before any stage runs (a bad value: ConfigError, exit 2); a build with nothing
        # to run does not resolve it (auto would import torch)
        device = resolve_device(cfg.run) if any(i.action == "run" for i in plan) else None
        if device is not None:
            log.info("run.device %s: stages run on %s", device.requested, device.type)
        outcomes: list[Outcome] = []
        failed = False
        for item in plan:
            if item.action == "keep":
                outcomes.append(kept[item.name])
            elif failed:
                outcomes.append(Outcome(item.name, "blocked", "an earlier stage failed", item.fingerprint))
            elif item.action == "run":
                log.info("[%s] run: %s", item.name, item.reason)
                for c in item.code_changes[:8]:
                    log.info("[%s]   %s via %s", item.name, c["file"], " -> ".join(c["via"]) or "(no longer reached)")
                o = run_stage(item, cfg, store, argv, device)
                if o.action == "failed":
                    failed = True
                    log.error("[%s] failed after %.1fs: %s", item.name, o.wall_s, o.error)
                else:
                    log.info("[%s] committed (%.1fs)", item.name, o.wall_s)
                outcomes.append(o)
            else:
                log.info("[%s] %s: %s", item.name, "skip" if item.action == "skip" else item.action, item.reason)
                outcomes.append(Outcome(item.name, item.action, item.reason, item.fingerprint))
        _write_last_build(store, outcomes, argv, config_path)
        return outcomes
    finally:
        store.unlock()


def _write_last_build(store: Store, outcomes: list[Outcome], argv: list[str], config_path: str) -> None:
    doc = {
        "config": str(Path(config_path).resolve()),
        "command": shlex.join(argv),
        "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "stages": {o.name: {"action": o.action, "reason": o.reason, "error": o.error, "wall_s": round(o.wall_s, 3),
                            "failed_metrics": o.failed_metrics} for o in outcomes},
    }
    atomic_write_text(store.root / "last_build.json", json.dumps(doc, indent=2))


def status(store: Store) -> dict:
    """The stable machine-readable summary printed by `specpipe status --json` (shape in README)."""
    last = {}
    with contextlib.suppress(OSError, ValueError):
        last = json.loads((store.root / "last_build.json").read_text())
    out = {"workdir": str(store.root), "config": last.get("config"), "last_command": last.get("command"),
           "last_finished": last.get("finished"), "stages": []}
    for spec in registry.stages():
        m = store.manifest(spec.name)
        lb = last.get("stages", {}).get(spec.name, {})
        entry = {
            "name": spec.name,
            "state": "committed" if m else ("failed" if lb.get("action") == "failed" else "not committed"),
            "fingerprint": m["fingerprint"] if m else None,
            "digest": m.get("digest") if m else None,
            "started": m["provenance"]["started"] if m else None,
            "wall_time_s": m["provenance"]["wall_time_s"] if m else None,
            "peak_rss_mb": m["provenance"]["peak_rss_mb"] if m else None,
            "metrics": m.get("metrics", {}) if m else {},
            "last_build": lb.get("action"),
            "last_reason": lb.get("reason"),
            "error": lb.get("error"),
            "failed_metrics": lb.get("failed_metrics"),
            "kept": m.get("kept", []) if m else [],     # --keep: accepted across code changes (pipeline/keep.py)
        }
        out["stages"].append(entry)
    return out
