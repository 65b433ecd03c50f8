"""The production repository's launch.sh (issue 22, defect 2): the process it leaves is the Triton server.

Upstream: TensorRT-LLM triton_backend/scripts/launch_triton_server.py (read at the stored versions
0a2e2c1f1268b34586393794045691b666ba28be and 0b06796b2c7895930fecff48a1e205ab14a19c51; the container copy is
/app/scripts/launch_triton_server.py) builds `mpirun --allow-run-as-root -n 1 <tritonserver>
--model-repository=<repo> --grpc-port=8001 --http-port=8000 --metrics-port=8002 ... --disable-auto-complete-config
--backend-config=python,shm-region-prefix-name=prefix0_ :` (ranks > 0 add `--model-control-mode=explicit
--load-model=tensorrt_llm`) and ends in `subprocess.Popen(cmd, env=env)` without waiting: `exec`'d as a container's
main process (old launch.sh, the serving image's ENTRYPOINT) it returns at once and the container stops.

For real: launch.sh runs the real Triton server (the CPU build from the nvidia-pytriton wheel, TRITONSERVER) on the
exported production repository; the container's LLM-API model code is replaced by an obviously FAKE TensorRT-LLM
model (tests/support/fake_trtllm_llmapi, LLMAPI_MODEL_DIR), since TensorRT-LLM cannot be installed here. The PID launch.sh
started as is the tritonserver process, answers /v2/health/ready on 127.0.0.1, serves the model, stays up, and
goes only when it is killed. On old main (6dec796) launch.sh execs the launcher script and the process is gone.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from stages import build, export

from support import SUPPORT
from support.synthetic import gate, run_stage, write_checkpoints

FAKE_MODEL = SUPPORT / "fake_trtllm_llmapi"


@pytest.fixture(scope="module")
def production(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("launch")
    write_checkpoints(root)
    gate(root, True)
    run_stage(root, build, build.Config())
    return run_stage(root, export, export.Config(speculators=False, cpu_repository=False)) / "triton"


def _argv(launch: Path, tmp: Path, launcher: bool = False, **env) -> list[str]:
    """What launch.sh exec's, captured by a stand-in executable that prints its argv (no server); `launcher`: a
    trtllm-llmapi-launch stand-in on PATH too."""
    tmp.mkdir(parents=True, exist_ok=True)
    show = tmp / "show_argv"
    show.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$(basename "$0")" "$@"\n')
    show.chmod(0o755)
    (tmp / "mpirun").symlink_to(show)
    e = {**os.environ, "LLMAPI_MODEL_DIR": str(FAKE_MODEL), "SPECPIPE_REPO": str(launch.parent),
         "SERVE_REPO": str(tmp / "serve"), "TRITONSERVER": "tritonserver", "PATH": f"{tmp}:{os.environ['PATH']}",
         "SPECPIPE_PREFLIGHT": "off", **env}   # the preflight has its own tests below
    (tmp / "tritonserver").symlink_to(show)
    if launcher:
        (tmp / "trtllm-llmapi-launch").symlink_to(show)
    r = subprocess.run(["bash", str(launch)], env=e, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


def test_launch_runs_the_command_launch_triton_server_py_builds(production, tmp_path):
    """World size 1: tritonserver itself with get_cmd's flags for rank 0; world size 2: mpirun with one app context
    per rank, rank 1 loading only the model (get_cmd, stored 0a2e2c1f / 0b06796b)."""
    launch = production / "launch.sh"
    serve = tmp_path / "one" / "serve"
    rank0 = [f"--model-repository={serve}", "--grpc-port=8001", "--http-port=8000", "--metrics-port=8002",
             "--disable-auto-complete-config", "--backend-config=python,shm-region-prefix-name=prefix0_"]
    assert _argv(launch, tmp_path / "one") == ["tritonserver", *rank0]
    serve = tmp_path / "two" / "serve"
    argv = _argv(launch, tmp_path / "two", WORLD_SIZE="2", HTTP_PORT="9000")
    rank = lambda i: [f"--model-repository={serve}", "--grpc-port=8001", "--http-port=9000",  # noqa: E731
                      "--metrics-port=8002", *(["--model-control-mode=explicit", "--load-model=tensorrt_llm"] if i else []),
                      "--disable-auto-complete-config", f"--backend-config=python,shm-region-prefix-name=prefix{i}_"]
    assert argv == ["mpirun", "--allow-run-as-root", "-n", "1", "tritonserver", *rank(0), ":",
                    "-n", "1", "tritonserver", *rank(1)]
    assert (serve / "tensorrt_llm" / "1" / "model.yaml").resolve() == (production / "tensorrt_llm" / "1" / "model.yaml")
    assert (serve / "tensorrt_llm" / "1" / "model.py").read_text() == (FAKE_MODEL / "model.py").read_text()


def test_launch_runs_the_server_under_trtllm_llmapi_launch_where_the_image_has_it(production, tmp_path):
    """tensorrt_llm/executor/proxy.py (stored 005bc848): without TLLM_SPAWN_PROXY_PROCESS=1 the LLM API spawns its
    worker with MPI_Comm_spawn even on one GPU; trtllm-llmapi-launch (stored 020c89e6) sets it and runs the MPI side
    (ranks > 0: worker nodes under mpirun). TP 1: the launcher around tritonserver; TP 2: mpirun -n 2 around it;
    LLMAPI_LAUNCH=none, or no launcher in the image: plain tritonserver; WORLD_SIZE > 1 keeps one server per rank."""
    launch = production / "launch.sh"
    rank0 = lambda d: [f"--model-repository={tmp_path / d / 'serve'}", "--grpc-port=8001", "--http-port=8000",  # noqa: E731
                       "--metrics-port=8002", "--disable-auto-complete-config",
                       "--backend-config=python,shm-region-prefix-name=prefix0_"]
    assert _argv(launch, tmp_path / "a", launcher=True) == ["trtllm-llmapi-launch", "tritonserver", *rank0("a")]
    assert _argv(launch, tmp_path / "b", launcher=True, TP_SIZE="2") == \
        ["mpirun", "--allow-run-as-root", "-n", "2", "trtllm-llmapi-launch", "tritonserver", *rank0("b")]
    assert _argv(launch, tmp_path / "c", launcher=True, LLMAPI_LAUNCH="none") == ["tritonserver", *rank0("c")]
    two = _argv(launch, tmp_path / "d", launcher=True, WORLD_SIZE="2")
    assert two[:5] == ["mpirun", "--allow-run-as-root", "-n", "1", "tritonserver"] and "trtllm-llmapi-launch" not in two
    assert "TP_SIZE=\"${TP_SIZE:-1}\"" in launch.read_text()     # model.yaml's tensor_parallel_size, written by export


def _preflight(launch: Path, tmp: Path, python: str, *, fake_site: bool) -> subprocess.CompletedProcess:
    """launch.sh with its preflight on, run by `python`; the server is a stand-in that prints its argv."""
    tmp.mkdir(parents=True, exist_ok=True)
    show = tmp / "tritonserver"
    show.write_text('#!/usr/bin/env bash\necho SERVER-STARTED "$@"\n')
    show.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update({"LLMAPI_MODEL_DIR": str(FAKE_MODEL), "SPECPIPE_REPO": str(launch.parent), "SERVE_REPO": str(tmp / "s"),
                "TRITONSERVER": str(show), "LLMAPI_LAUNCH": "none", "PYTHON": python})
    if fake_site:
        env["PYTHONPATH"] = str(FAKE_MODEL / "site")
    return subprocess.run(["bash", str(launch)], env=env, capture_output=True, text=True, timeout=120)


def test_preflight_stops_before_the_server_and_names_the_fix(production, tmp_path):
    """Real pythons: one without site-packages (no openai at all) and vLLM's environment (a real openai that has
    PartReasoningText, no tensorrt_llm); the LLM-API model's imports come from a FAKE tensorrt_llm package."""
    from support.vllm_env import vllm_install

    launch = production / "launch.sh"
    nosite = tmp_path / "python-nosite"
    nosite.write_text(f'#!/usr/bin/env bash\nexec {sys.executable} -S "$@"\n')
    nosite.chmod(0o755)
    r = _preflight(launch, tmp_path / "a", str(nosite), fake_site=True)
    assert r.returncode == 3 and "SERVER-STARTED" not in r.stdout, r.stdout + r.stderr
    assert "openai (not installed) lacks" in r.stderr and "pip install 'openai>=1.108.1'" in r.stderr
    assert "tritonserver not started" in r.stderr
    py = vllm_install().python
    r = _preflight(launch, tmp_path / "b", py, fake_site=False)           # openai fine, no tensorrt_llm
    assert r.returncode == 3 and "SERVER-STARTED" not in r.stdout
    assert "the LLM-API model imports tensorrt_llm, which fails: ModuleNotFoundError" in r.stderr, r.stderr
    r = _preflight(launch, tmp_path / "c", py, fake_site=True)
    assert r.returncode == 0, r.stderr
    assert "preflight: openai and the LLM-API model's imports load" in r.stdout and "SERVER-STARTED" in r.stdout


def test_launch_refuses_a_bad_world_size_and_a_missing_repository(production, tmp_path):
    base = {**os.environ, "LLMAPI_MODEL_DIR": str(FAKE_MODEL), "SERVE_REPO": str(tmp_path / "serve")}
    r = subprocess.run(["bash", str(production / "launch.sh")], env={**base, "SPECPIPE_REPO": str(production),
                       "WORLD_SIZE": "two"}, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "WORLD_SIZE must be a positive integer" in r.stderr
    r = subprocess.run(["bash", str(production / "launch.sh")], env={**base, "SPECPIPE_REPO": str(tmp_path)},
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "config.pbtxt: mount the exported triton/ there" in r.stderr


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2) as r:  # noqa: S310
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def test_the_process_launch_sh_leaves_is_the_triton_server_and_lives_until_killed(production, tmp_path):
    from runtime.serving import triton_server as T

    try:
        inst = T.find_install()
    except T.TritonServerError as e:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(f"no CPU Triton server: {e}")
    http, grpc, metrics = T.free_port(), T.free_port(), T.free_port()
    env = {**T._env(inst), "TRITONSERVER": str(inst.binary), "LLMAPI_MODEL_DIR": str(FAKE_MODEL),
           "SPECPIPE_REPO": str(production), "SERVE_REPO": str(tmp_path / "serve"),
           "HTTP_PORT": str(http), "GRPC_PORT": str(grpc), "METRICS_PORT": str(metrics),
           "SPECPIPE_PREFLIGHT": "off", "LLMAPI_LAUNCH": "none"}   # both checked above; here: the exec'd server
    cpu_flags = [f"--backend-directory={T._backend_dir(inst, tmp_path)}", f"--cache-directory={inst.root / 'caches'}",
                 "--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1",
                 "--allow-gpu-metrics=false", "--pinned-memory-pool-byte-size=0", "--exit-timeout-secs=5"]
    shm_before = set(Path("/dev/shm").glob("prefix0_*"))
    with open(tmp_path / "launch.log", "wb") as log:  # the child holds its own copy of the descriptor
        proc = subprocess.Popen(["bash", str(production / "launch.sh"), *cpu_flags], env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not _ready(http):
            assert proc.poll() is None, f"launch.sh's process exited ({proc.returncode}): " \
                                        f"{(tmp_path / 'launch.log').read_text(errors='replace')[-2000:]}"
            assert time.monotonic() < deadline, "not ready in 120 s"
            time.sleep(0.3)
        # the PID launch.sh was started as is now the server itself (exec), not a shell or a launcher script
        assert Path(f"/proc/{proc.pid}/exe").resolve() == inst.binary.resolve()
        assert Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")[0] == str(inst.binary).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{http}/v2/models/tensorrt_llm/generate", method="POST",
                                     data=json.dumps({"text_input": "hello"}).encode())
        with urllib.request.urlopen(req, timeout=30) as r:  # noqa: S310
            assert json.loads(r.read())["text_output"] == "FAKE-TRTLLM:hello"
        time.sleep(5)
        assert proc.poll() is None and _ready(http), "the server did not stay up"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) is not None
        assert not _ready(http)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        for region in set(Path("/dev/shm").glob("prefix0_*")) - shm_before:
            region.unlink(missing_ok=True)
