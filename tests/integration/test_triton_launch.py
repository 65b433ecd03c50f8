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
model (tests/integration/fake_trtllm_llmapi, LLMAPI_MODEL_DIR), since TensorRT-LLM cannot be installed here. The PID launch.sh
started as is the tritonserver process, answers /v2/health/ready on 127.0.0.1, serves the model, stays up, and
goes only when it is killed. On old main (6dec796) launch.sh execs the launcher script and the process is gone.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from stages import build, export

from support.synthetic import gate, run_stage, write_checkpoints

FAKE_MODEL = Path(__file__).parent / "fake_trtllm_llmapi"


@pytest.fixture(scope="module")
def production(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("launch")
    write_checkpoints(root)
    gate(root, True)
    run_stage(root, build, build.Config())
    return run_stage(root, export, export.Config(speculators=False, cpu_repository=False)) / "triton"


def _argv(launch: Path, tmp: Path, **env) -> list[str]:
    """What launch.sh exec's, captured by a stand-in executable that prints its argv (no server)."""
    tmp.mkdir(parents=True, exist_ok=True)
    show = tmp / "show_argv"
    show.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$(basename "$0")" "$@"\n')
    show.chmod(0o755)
    (tmp / "mpirun").symlink_to(show)
    e = {**os.environ, "LLMAPI_MODEL_DIR": str(FAKE_MODEL), "SPECPIPE_REPO": str(launch.parent),
         "SERVE_REPO": str(tmp / "serve"), "TRITONSERVER": "tritonserver", "PATH": f"{tmp}:{os.environ['PATH']}", **env}
    (tmp / "tritonserver").symlink_to(show)
    r = subprocess.run(["bash", str(launch)], env=e, capture_output=True, text=True, timeout=30)
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
           "HTTP_PORT": str(http), "GRPC_PORT": str(grpc), "METRICS_PORT": str(metrics)}
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
