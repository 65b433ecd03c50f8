"""Writing a file so that a reader, or a build resumed after a kill, sees it whole or not at all."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def atomic_write_text(path: Path, text: str) -> None:
    """`path` holds `text` whole or not at all: a temporary file in the same directory, fsynced, then renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)          # mkstemp creates 0600; reports and manifests are for people to read
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def publish_tree(root: Path) -> int:
    """Make every file under `root` world-readable (0644, 0755 if its owner may execute it) and every directory
    world-traversable (0755), whatever the umask and whatever wrote them (safetensors and mkstemp write 0600): a
    deployment is read by a container user other than the one that built it (Kubernetes runAsNonRoot,
    `docker run --user`). Hard-linked files share their mode with the linked source. Returns how many changed."""
    import stat

    n = 0
    root = Path(root)
    for p in [root, *root.rglob("*")]:
        st = p.lstat()
        if stat.S_ISLNK(st.st_mode):
            continue
        want = 0o755 if stat.S_ISDIR(st.st_mode) or st.st_mode & stat.S_IXUSR else 0o644
        if stat.S_IMODE(st.st_mode) != want:
            os.chmod(p, want)
            n += 1
    return n
