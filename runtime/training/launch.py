"""The training job under torchrun: `<scratch>/job.json`, the torchrun command (one node, or several over a c10d
rendezvous, with the shell lines the other nodes run in `<scratch>/worker_commands.sh`), the workers'
environment, and the run itself: rank 0's progress into the stage's bars, stderr into `<scratch>/torchrun.log`,
stopped after `launcher.timeout_s`. The workers run `python -m runtime.training.draft_training --job job.json`."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import threading
from pathlib import Path

from runtime.training.job import JobError
from runtime.training.progress import Bars, follow_output

WORKER_MODULE = "runtime.training.draft_training"


def train_torchrun(job: dict, launcher, scratch_dir: Path, threads: int | None, bars: Bars, log) -> dict:
    """The job under torchrun as the section's `launcher` says. Returns rank 0's result.json; JobError when
    torchrun ran past its time limit, a worker reported an error or torchrun failed."""
    job_path = write_job(scratch_dir, job)
    cmd = torchrun_cmd(launcher, job_path, launcher.node_rank)
    env = worker_env(threads)
    if launcher.nnodes > 1:
        write_worker_commands(scratch_dir, launcher, job_path, env, log)
    log.info("launching: %s", " ".join(cmd))
    err_log = scratch_dir / "torchrun.log"
    rc, errors, timed_out = run_torchrun(cmd, env, err_log, bars, launcher.timeout_s, log)
    if timed_out:
        raise JobError(f"torchrun ran past train_draft.launcher.timeout_s={launcher.timeout_s} and was "
                       f"stopped (a node that never joined, or a hung collective); its log: {err_log}")
    if errors:
        raise JobError(errors[0])
    if rc != 0:
        tail = err_log.read_text()[-3000:]
        raise JobError(f"torchrun exited with status {rc}; last lines of {err_log}:\n{tail}")
    return json.loads((scratch_dir / "result.json").read_text())


def torchrun_cmd(launcher, job_path: Path, node_rank: int) -> list[str]:
    L = launcher
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(L.nproc_per_node)]
    if L.nnodes == 1:
        cmd += ["--standalone"]   # a free local port: no clash with other jobs on this host
    else:
        cmd += ["--nnodes", str(L.nnodes), "--node-rank", str(node_rank), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", L.rdzv_endpoint, "--rdzv-id", L.rdzv_id]
    return cmd + ["-m", WORKER_MODULE, "--job", str(job_path)]


def write_job(scratch_dir: Path, job: dict) -> Path:
    """`<scratch>/job.json` for the workers; a previous run's result.json is removed."""
    scratch_dir.mkdir(parents=True, exist_ok=True)
    job_path = scratch_dir / "job.json"
    job_path.write_text(json.dumps(job, indent=2))
    (scratch_dir / "result.json").unlink(missing_ok=True)
    return job_path


def worker_env(threads: int | None) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.setdefault("OMP_NUM_THREADS", str(threads or 1))
    # the repository root on the path, so `-m runtime.training.draft_training` resolves without an install
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    return env


def write_worker_commands(scratch_dir: Path, launcher, job_path: Path, env: dict, log) -> None:
    """Multi-node: one self-contained shell line per other node (what the Slurm script runs there), written to
    `<scratch>/worker_commands.sh` and logged."""
    pre = ["env", f"PYTHONPATH={env['PYTHONPATH']}", "PYTHONUNBUFFERED=1", f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}"]
    others = [shlex.join(pre + torchrun_cmd(launcher, job_path, r)) for r in range(1, launcher.nnodes)]
    (scratch_dir / "worker_commands.sh").write_text("\n".join(others) + "\n")
    log.info("multi-node: run on node r (1..%d), with this workdir on a shared filesystem:\n  %s",
             launcher.nnodes - 1, "\n  ".join(others))


def run_torchrun(cmd: list[str], env: dict, err_log: Path, bars: Bars, timeout_s: float, log) -> tuple[int, list[str], bool]:
    """torchrun with its stderr in `err_log`, stopped after `timeout_s`. Returns (exit status, the workers'
    error messages, whether the time limit stopped it)."""
    errors: list[str] = []
    timed_out = threading.Event()
    with open(err_log, "w") as err, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env) as proc:
        def _stop():   # a hung job (a lost node, a collective that never completes) still ends
            timed_out.set()
            proc.terminate()
            killer = threading.Timer(30, proc.kill)   # torchrun forwards SIGTERM to its workers; in case it hangs too
            killer.daemon = True
            killer.start()
        watchdog = threading.Timer(timeout_s, _stop)
        watchdog.daemon = True
        watchdog.start()
        try:
            follow_output(proc.stdout, bars, errors, log)
            rc = proc.wait(timeout=60 if timed_out.is_set() else None)
        except BaseException:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
        finally:
            watchdog.cancel()
    return rc, errors, timed_out.is_set()
