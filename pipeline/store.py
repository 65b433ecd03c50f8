"""The artifact store: content-hashed, atomically committed stage outputs under one workdir.

Layout (see docs/architecture.md):

    <workdir>/
      .lock                       held (flock) by the one build/plan that may write here
      artifacts/<stage>/          committed output; trusted only if manifest.json exists and parses
      artifacts/<stage>/manifest.json   written last: fingerprint, file digests, provenance, metrics
      .tmp/<stage>-<rand>/        a stage's output while it runs; removed on failure and at the next start
      scratch/<stage>/<fp>/       resumable work (checkpoints, dumps), keyed by fingerprint; removed on commit
      logs/<stage>.log, logs/build.log
      last_build.json             what the last build did to each stage (ran / skipped / failed, and why)
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import signal
import tempfile
from pathlib import Path

from pipeline.errors import LockedError
from pipeline.stage import Artifact, iter_files
from runtime.files import atomic_write_text

MANIFEST = "manifest.json"


def fault_point(stage: str, point: str) -> None:
    """Fault injection for crash tests: SPECPIPE_FAULT=<stage>:<point> kills this process with SIGKILL there;
    SPECPIPE_FAULT=<stage>:<point>:TERM sends it SIGTERM instead (what Slurm's preemption and time limit send)."""
    fault = os.environ.get("SPECPIPE_FAULT", "")
    if fault == f"{stage}:{point}":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault == f"{stage}:{point}:TERM":
        os.kill(os.getpid(), signal.SIGTERM)


def file_sha256(path: Path, bufsize: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


def digest_dir(root: Path) -> tuple[str, dict[str, dict]]:
    """sha256 over (relative path, file sha256) of every file except the manifest."""
    files: dict[str, dict] = {}
    h = hashlib.sha256()
    for rel in iter_files(root):
        if rel.as_posix() == MANIFEST:
            continue
        p = root / rel
        d = file_sha256(p)
        files[rel.as_posix()] = {"sha256": d, "bytes": p.stat().st_size}
        h.update(rel.as_posix().encode() + b"\0" + d.encode() + b"\n")
    return h.hexdigest(), files


class Store:
    def __init__(self, workdir: Path):
        self.root = Path(workdir)
        self.artifacts = self.root / "artifacts"
        self.tmp = self.root / ".tmp"
        self.scratch = self.root / "scratch"
        self.logs = self.root / "logs"
        self._lock_fd: int | None = None

    # ------------------------------------------------------------ locking
    def lock(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise LockedError(
                f"workdir {self.root} is in use by another specpipe process (pid {holder}); "
                "wait for it to finish or use another --workdir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    # ------------------------------------------------------------ reading
    def manifest(self, stage: str) -> dict | None:
        p = self.artifacts / stage / MANIFEST
        try:
            m = json.loads(p.read_text())
        except (OSError, ValueError):
            return None
        return m if isinstance(m, dict) and m.get("stage") == stage and "fingerprint" in m else None

    def artifact(self, stage: str) -> Artifact | None:
        m = self.manifest(stage)
        return Artifact(stage, self.artifacts / stage, m) if m else None

    def verify(self, stage: str) -> list[str]:
        """Files whose content no longer matches the manifest (for `status --verify`)."""
        m = self.manifest(stage)
        if m is None:
            return ["no manifest"]
        root = self.artifacts / stage
        bad = []
        for rel, info in m.get("files", {}).items():
            p = root / rel
            if not p.exists():
                bad.append(f"{rel}: missing")
            elif file_sha256(p) != info["sha256"]:
                bad.append(f"{rel}: changed")
        return bad

    # ------------------------------------------------------------ writing
    def clean_tmp(self) -> list[str]:
        """Remove what interrupted runs left behind. Call only while holding the lock."""
        removed = []
        if self.tmp.exists():
            for p in self.tmp.iterdir():
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p.name)
        if self.artifacts.exists():
            for p in self.artifacts.iterdir():
                if p.name.startswith(".old-"):
                    shutil.rmtree(p, ignore_errors=True)
                    removed.append(p.name)
        return removed

    def new_tmp(self, stage: str) -> Path:
        self.tmp.mkdir(parents=True, exist_ok=True)
        d = Path(tempfile.mkdtemp(dir=self.tmp, prefix=f"{stage}-"))
        d.chmod(0o755)      # mkdtemp makes 0700; deployments name paths inside artifacts/<stage>/ other users read
        return d

    def scratch_dir(self, stage: str, fingerprint: str) -> Path:
        d = self.scratch / stage / fingerprint[:16]
        d.mkdir(parents=True, exist_ok=True)
        # scratch of older fingerprints of this stage is stale: drop it
        for other in (self.scratch / stage).iterdir():
            if other != d:
                shutil.rmtree(other, ignore_errors=True)
        return d

    def record_keep(self, stage: str, entry: dict) -> None:
        """Append a keep (pipeline/keep.py) to a committed artifact's manifest, atomically: the files and their
        digests are untouched."""
        m = self.manifest(stage)
        if m is None:
            raise RuntimeError(f"record_keep: {stage} has no committed artifact")
        m["kept"] = [*m.get("kept", []), entry]
        atomic_write_text(self.artifacts / stage / MANIFEST, json.dumps(m, indent=2, sort_keys=True, default=str))

    def commit(self, stage: str, tmp_dir: Path, manifest: dict) -> Artifact:
        """Move tmp_dir into place and write its manifest last. Crash-safe at every step:
        an artifact dir without a manifest is never trusted, and the previous artifact is only
        removed once the new one is complete on disk."""
        digest, files = digest_dir(tmp_dir)
        manifest = {**manifest, "digest": digest, "files": files}
        self.artifacts.mkdir(parents=True, exist_ok=True)
        self.artifacts.chmod(0o755)     # the deployments' paths run through it, whatever the umask
        final = self.artifacts / stage
        if final.exists():
            (final / MANIFEST).unlink(missing_ok=True)      # untrusted from here on
            old = self.artifacts / f".old-{stage}-{os.getpid()}"
            os.rename(final, old)
            fault_point(stage, "old-moved")
            shutil.rmtree(old, ignore_errors=True)
        os.rename(tmp_dir, final)
        fault_point(stage, "after-rename")
        atomic_write_text(final / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True, default=str))
        shutil.rmtree(self.scratch / stage, ignore_errors=True)
        return Artifact(stage, final, manifest)
