"""`specpipe slurm`: the generated sbatch script is valid bash, quotes what it must, and its node logic works
(run here with bash, without Slurm: the worker branch joins train_draft or leaves when node 0 is done)."""
from __future__ import annotations

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
    text, _ = _gen(tmp_path, "--nodes", "2")
    node = _node_script(text)
    wd = tmp_path / "wd"
    wd.mkdir()
    (wd / ".start").touch()
    p = _run_worker(node, wd, 1)
    time.sleep(0.5)
    (wd / ".done").touch()
    p.communicate(timeout=30)
    assert p.returncode == 0


def test_submit_without_sbatch_says_what_to_do(tmp_path):
    r = run_cli("slurm", str(CONFIG), "--workdir", str(tmp_path / "w"), "--image", "img", "--submit",
                env={"PATH": "/usr/bin:/bin"})
    if r.returncode == 0:
        pytest.skip("sbatch exists on this machine")
    assert r.returncode == 2 and "sbatch is not on PATH" in r.stderr and "sbatch " in r.stderr
    assert (tmp_path / "w" / "slurm" / "specpipe.sbatch").exists()   # the script is written either way
