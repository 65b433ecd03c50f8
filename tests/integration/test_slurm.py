"""`specpipe slurm`: the generated sbatch script is valid bash, quotes what it must, and its node logic works
(run here with bash, without Slurm: the worker branch joins train_draft or leaves when node 0 is done)."""
from __future__ import annotations

import contextlib
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, run_cli

CONFIG = REPO / "configs" / "llama70b_fp8_eagle3.yaml"


def _gen(tmp_path: Path, *args: str) -> tuple[str, Path]:
    wd = tmp_path / "my runs" / "l70"
    out = tmp_path / "job.sbatch"
    r = run_cli("slurm", str(CONFIG), "--workdir", str(wd), "--image", "nvcr.io#org/specpipe:1.2.1",
                "--mount", "/lustre:/lustre", "--out", str(out), *args)
    assert r.returncode == 0, r.stderr
    return out.read_text(), wd


def _node_script(text: str) -> str:
    return re.search(r"<<'NODE' \|\| true\n(.*?)\nNODE\n", text, re.S).group(1)


def test_single_node_script(tmp_path):
    text, wd = _gen(tmp_path, "--gpus-per-node", "8", "--partition", "gpu", "--account", "proj", "-o", "data.max_samples=10")
    assert subprocess.run(["bash", "-n", "-c", text]).returncode == 0
    assert "#SBATCH --nodes=1" in text and "#SBATCH --gpus-per-node=8" in text and "#SBATCH --partition=gpu" in text
    assert f'#SBATCH --output="{wd.resolve()}/logs/slurm-%j.out"' in text
    assert "--container-image='nvcr.io#org/specpipe:1.2.1'" in text and "--container-mounts=/lustre:/lustre" in text
    assert shlex.quote(str(wd.resolve())) in text          # the space is quoted
    assert "-o data.max_samples=10" in text
    assert '"nproc_per_node": 8, "nnodes": 1' in text and "rdzv_endpoint\": null" in text
    assert '"fsdp": true' in text      # the 70B config's sharding survives the allocation's launcher


def test_node0_command_is_accepted_by_the_real_cli(tmp_path):
    text, _ = _gen(tmp_path, "--nodes", "2", "--gpus-per-node", "8")
    node = _node_script(text)
    build = next(line for line in node.splitlines() if "specpipe build" in line)
    cmd = build.split("set +e; ", 1)[1].split("; rc=$?", 1)[0]
    # the same arguments through `specpipe plan` (nothing runs), with the rendezvous host filled in by bash
    cmd = cmd.replace("specpipe build", "specpipe plan", 1)
    env = {**os.environ, "RDZV": "node17:29500", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    r = subprocess.run(["bash", "-c", cmd], env=env, capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert "train_draft  run" in r.stdout


def _run_worker(node: str, wd: Path, rank: int) -> subprocess.Popen:
    env = {**os.environ, "SLURM_NODEID": str(rank), "SPECPIPE_WORKDIR": str(wd),
           "SPECPIPE_START": str(wd / ".start"), "SPECPIPE_DONE": str(wd / ".done")}
    return subprocess.Popen(["bash", "-c", node.replace("sleep 10", "sleep 0.2")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_worker_joins_train_draft_with_its_line(tmp_path):
    text, _ = _gen(tmp_path, "--nodes", "3")
    node = _node_script(text)
    wd = tmp_path / "wd"
    stale = wd / "scratch" / "train_draft" / "old"
    stale.mkdir(parents=True)
    (stale / "worker_commands.sh").write_text("echo stale-1\necho stale-2\n")
    time.sleep(1.1)
    (wd / ".start").touch()
    p = _run_worker(node, wd, 2)
    time.sleep(1.0)
    assert p.poll() is None                          # a commands file older than the job is ignored
    fresh = wd / "scratch" / "train_draft" / "abc"
    fresh.mkdir()
    time.sleep(1.1)
    (fresh / "worker_commands.sh").write_text("echo rank-1-runs\necho rank-2-runs\n")
    out, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    assert out.strip() == "rank-2-runs"


def test_worker_leaves_when_node0_is_done(tmp_path):
    """A worker waits for train_draft's commands while node 0 runs, and leaves as soon as node 0 is done (the
    draft was already trained): without running anything (not a previous job's commands file) and not before."""
    text, _ = _gen(tmp_path, "--nodes", "2")
    node = _node_script(text)
    wd = tmp_path / "wd"
    ran = tmp_path / "ran.log"
    stale = wd / "scratch" / "train_draft" / "old"
    stale.mkdir(parents=True)
    (stale / "worker_commands.sh").write_text(f"echo stale-1 >> {ran}\necho stale-2 >> {ran}\n")
    time.sleep(1.1)
    (wd / ".start").touch()
    p = _run_worker(node, wd, 1)
    try:
        time.sleep(1.5)
        assert p.poll() is None, p.communicate()   # still waiting: nothing but the done marker ends it
        (wd / ".done").touch()
        t0 = time.monotonic()
        try:
            out, err = p.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            pytest.fail("the worker kept waiting after node 0's done marker")
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 0 and (out, err) == ("", "")
    assert time.monotonic() - t0 < 5              # at its next poll (every 0.2 s here), not at some timeout
    assert not ran.exists()                       # it ran no worker command


def test_submit_without_sbatch_says_what_to_do(tmp_path):
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    r = run_cli("slurm", str(CONFIG), "--workdir", str(tmp_path / "w"), "--image", "img", "--submit",
                env={"PATH": str(empty)})
    assert r.returncode == 2 and "sbatch is not on PATH" in r.stderr and "sbatch " in r.stderr
    assert (tmp_path / "w" / "slurm" / "specpipe.sbatch").exists()   # the script is written either way


# ------------------------------------------------------------------ a real single-node Slurm (Debian packages)

SLURM_BINS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    """munged + slurmctld + slurmd on 127.0.0.1 with free ports, in a private directory; stopped by PID."""
    import shutil
    import signal

    paths = {b: shutil.which(b) or shutil.which(b, path="/usr/sbin:/usr/bin") for b in SLURM_BINS}
    missing = [b for b, p in paths.items() if not p]
    if missing:
        pytest.skip(f"Slurm daemons not installed ({', '.join(missing)}); .ci/run installs Debian's slurmctld, slurmd, "
                    "slurm-client, munge")
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool", "log", "munge/run"):
        (d / sub).mkdir(parents=True)
    key = d / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    sock = d / "munge" / "run" / "munge.socket"
    subprocess.run([paths["munged"], "--force", f"--key-file={key}", f"--socket={sock}", f"--pid-file={d}/munge/munged.pid",
                    f"--log-file={d}/munge/munged.log", f"--seed-file={d}/munge/seed"], check=True)
    conf = d / "slurm.conf"
    conf.write_text(f"""ClusterName=specpipetest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
AuthInfo=socket={sock}
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmUser=root
SlurmdUser=root
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
NodeName=localhost NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
""")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    subprocess.run([paths["slurmctld"], "-f", str(conf)], check=True, env=env)
    subprocess.run([paths["slurmd"], "-f", str(conf), "-N", "localhost"], check=True, env=env)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        r = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True)
        if r.stdout.strip() == "idle":
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"single-node Slurm did not become idle: {(d / 'log' / 'slurmctld.log').read_text()[-2000:]}")
    yield env
    for pidfile in ("slurmd.pid", "slurmctld.pid", "munge/munged.pid"):
        p = d / pidfile
        if p.exists():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(p.read_text().strip()), signal.SIGTERM)


def test_real_slurm_submission_runs_the_pipeline(tmp_path, slurm_cluster):
    """`specpipe slurm --submit` on a real single-node Slurm: the job builds target and data, and the
    committed fingerprints equal those of `specpipe plan` with the same config."""
    import json

    from pipeline import registry

    from conftest import TINY_CONFIG, status_json, tiny_overrides

    wd = tmp_path / "w"
    ov = tiny_overrides("target", "data")
    ov += [x for n in registry.names() if n not in ("target", "data") for x in ("-o", f"{n}.enabled=false")]
    env = {**slurm_cluster, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    r = run_cli("slurm", str(TINY_CONFIG), "--workdir", str(wd), "--gpus-per-node", "0", "--time", "00:20:00",
                *ov, "--submit", env=env)
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip().split()[-1]
    assert job_id.isdigit(), r.stdout
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        q = subprocess.run(["squeue", "-h", "-j", job_id], env=env, capture_output=True, text=True)
        if not q.stdout.strip():
            break
        time.sleep(1)
    else:
        pytest.fail("the Slurm job did not finish in 10 minutes")
    out = (wd / "logs" / f"slurm-{job_id}.out").read_text()
    assert (wd / f".slurm-{job_id}.done").exists(), out[-3000:]
    st = {s["name"]: s for s in status_json(wd)["stages"]}
    assert st["target"]["state"] == "committed" and st["data"]["state"] == "committed", out[-3000:]
    plan = run_cli("plan", str(TINY_CONFIG), "--workdir", str(wd), "--json", *ov)
    fps = {i["stage"]: i for i in json.loads(plan.stdout)}
    assert fps["target"]["action"] == "skip" and fps["data"]["action"] == "skip"
    assert fps["target"]["fingerprint"] == st["target"]["fingerprint"]
