"""Every file a deployment reads is world-readable, every directory on the way world-traversable: containers run as a
user other than the one that built the run (Kubernetes runAsNonRoot, `docker run --user`), and safetensors / mkstemp
write 0600 (quantize/target_fp8/model.safetensors was 0600 and hard-linked into triton/)."""
from __future__ import annotations

import os
import stat
from pathlib import Path

# What a deployment loads: the Triton repositories and the speculators export (export/), the TensorRT-LLM deployment
# (build/deployment/), the FP8 target every serve command names (quantize/target_fp8/), and the drafts they name.
TREES = ("export", "build/deployment", "quantize/target_fp8", "train_draft/draft")


def unreadable(root: Path, top: Path) -> list[str]:
    """Files not readable by others, directories others cannot list and enter, from `top` down to `root`'s leaves."""
    bad = []
    for p in [*[d for d in root.parents if top in d.parents or d == top], root, *root.rglob("*")]:
        if p.is_symlink():
            continue
        m = p.stat().st_mode
        need = (stat.S_IROTH | stat.S_IXOTH) if p.is_dir() else stat.S_IROTH
        if m & need != need:
            bad.append(f"{p.relative_to(top.parent)} {oct(stat.S_IMODE(m))}")
    return bad


def test_every_exported_file_is_world_readable(run_dir):
    arts = run_dir / "artifacts"
    bad = []
    for t in TREES:
        assert (arts / t).is_dir(), t
        bad += unreadable(arts / t, arts)
    assert not bad, f"not readable by a container user other than the builder: {sorted(set(bad))}"
    # the hard-linked weights the issue found at 0600
    assert stat.S_IMODE((arts / "export/triton/tensorrt_llm/1/target_fp8/model.safetensors").stat().st_mode) == 0o644


def test_publish_tree_ignores_the_umask(tmp_path):
    from runtime.files import publish_tree

    old = os.umask(0o077)
    try:
        d = tmp_path / "repo" / "sub"
        d.mkdir(parents=True)
        (d / "w.safetensors").write_bytes(b"x")
        (d / "run.sh").write_text("#!/bin/sh\n")
        (d / "run.sh").chmod(0o700)
    finally:
        os.umask(old)
    publish_tree(tmp_path / "repo")
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [tmp_path / "repo", d, *d.iterdir()]}
    assert modes == {"repo": 0o755, "sub": 0o755, "w.safetensors": 0o644, "run.sh": 0o755}
