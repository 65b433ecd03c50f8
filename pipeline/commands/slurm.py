"""`specpipe slurm`: the sbatch script (pipeline/slurm.py renders it) written for a run, and optionally submitted."""
from __future__ import annotations

from pathlib import Path

from pipeline.errors import UsageError


def write_script(cfg, job, path: Path) -> None:
    from pipeline.slurm import render

    path.parent.mkdir(parents=True, exist_ok=True)
    (Path(job.workdir) / "logs").mkdir(parents=True, exist_ok=True)   # Slurm opens --output before the script runs
    path.write_text(render(cfg, job))
    path.chmod(0o755)


def submit(path: Path):
    """sbatch `path`; the CompletedProcess (stdout/stderr captured). UsageError where sbatch is not on PATH."""
    import shutil
    import subprocess

    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise UsageError(f"--submit: sbatch is not on PATH here; on a Slurm login node run: sbatch {path}")
    return subprocess.run([sbatch, str(path)], capture_output=True, text=True)
