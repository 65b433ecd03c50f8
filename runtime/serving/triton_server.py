"""Start and stop a real Triton Inference Server from the `nvidia-pytriton` wheel (CPU, no Docker).

The wheel bundles the server binary (2.51.0), its libraries and the Python backend, but not in a layout the
server can use as is: the Python-backend stub for this interpreter has to sit next to `libtriton_python.so`
in a backend directory, the stub must find this venv's `python3` first on PATH (numpy < 2 lives there) and
the interpreter's own libpython first in LD_LIBRARY_PATH.

What this module guarantees:
- every endpoint is bound to 127.0.0.1, on free ports unless ports are given;
- the readiness wait is bounded, and a server that exits or never gets ready raises with its log tail;
- models are loaded explicitly (`--model-control-mode=explicit`), one by one, so a broken model raises
  `TritonServerError` carrying the server's own message instead of silently killing the server;
- `stop()` ends the server by its PID (SIGTERM, then SIGKILL of its process group after a grace period)
  and removes the `/dev/shm` regions of this server only (they carry a per-server prefix).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from runtime.errors import RuntimeFailure


class TritonServerError(RuntimeFailure):
    """The server could not be started, did not get ready, or refused to load a model (message included)."""


# ------------------------------------------------------------------------------------------ discovery


@dataclass(frozen=True)
class TritonInstall:
    root: Path            # .../site-packages/pytriton/tritonserver
    binary: Path
    libs: Path            # .../site-packages/nvidia_pytriton.libs
    python_backend: Path  # libtriton_python.so + triton_python_backend_utils.py
    stub: Path            # triton_python_backend_stub for this Python version


def find_install() -> TritonInstall:
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise TritonServerError("nvidia-pytriton is not installed: pip install 'specpipe[serve]' "
                                "(nvidia-pytriton==0.7.0, tritonclient[grpc,http]==2.51.0)")
    pkg = Path(list(spec.submodule_search_locations)[0])
    root = pkg / "tritonserver"
    pyver = f"{sys.version_info[0]}.{sys.version_info[1]}"
    inst = TritonInstall(root=root, binary=root / "bin" / "tritonserver", libs=pkg.parent / "nvidia_pytriton.libs",
                         python_backend=root / "backends" / "python",
                         stub=root / "python_backend_stubs" / pyver / "triton_python_backend_stub")
    for p in (inst.binary, inst.libs, inst.python_backend / "libtriton_python.so", inst.stub):
        if not p.exists():
            raise TritonServerError(f"incomplete nvidia-pytriton install: {p} is missing "
                                    f"(Python {pyver} needs a matching Python-backend stub)")
    return inst


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _backend_dir(inst: TritonInstall, where: Path) -> Path:
    """A backend directory the server accepts: the Python backend plus the stub for this interpreter."""
    d = where / "backends" / "python"
    d.mkdir(parents=True, exist_ok=True)
    for src in (inst.python_backend / "libtriton_python.so", inst.python_backend / "triton_python_backend_utils.py",
                inst.stub):
        shutil.copy2(src, d / src.name)
    return where / "backends"


def _env(inst: TritonInstall, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, **(extra or {})}
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    # The stub must load the same libpython as this interpreter, and find this venv's python3 (numpy < 2).
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(inst.libs), libdir, env.get("LD_LIBRARY_PATH", "")) if p)
    env["PATH"] = os.pathsep.join(p for p in (str(Path(sys.executable).parent), env.get("PATH", "")) if p)
    return env


# ------------------------------------------------------------------------------------------ server


@dataclass
class TritonServer:
    repositories: list[Path]
    http_port: int
    grpc_port: int
    metrics_port: int
    work_dir: Path
    log_path: Path
    shm_prefix: str
    process: subprocess.Popen | None = None
    loaded: list[str] = field(default_factory=list)
    _own_work_dir: bool = False

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    # -- HTTP helpers (stdlib only: the server's own API, no client library needed here)
    def _request(self, method: str, path: str, body: dict | None = None, timeout: float = 5.0) -> tuple[int, dict]:
        data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
        req = urllib.request.Request(f"http://{self.http_url}{path}", data=data, method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - fixed http://127.0.0.1 URL
                raw = r.read()
                return r.status, (json.loads(raw) if raw else {})
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                return e.code, json.loads(raw) if raw else {}
            except ValueError:
                return e.code, {"error": raw.decode(errors="replace")}

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise TritonServerError(f"tritonserver exited with code {self.process.returncode} before it was "
                                        f"ready; its log ({self.log_path}):\n{self.log_tail()}")
            try:
                status, _ = self._request("GET", "/v2/health/ready", timeout=1.0)
                if status == 200:
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.1)
        raise TritonServerError(f"tritonserver not ready after {timeout:.0f}s; its log ({self.log_path}):\n{self.log_tail()}")

    def load(self, model: str, timeout: float = 600.0, parameters: dict[str, str] | None = None,
             decoupled: bool | None = None) -> None:
        """Load (or reload) one model; raises TritonServerError with the server's message when it fails.
        `parameters` (entries of the model config's `parameters`) and `decoupled` (its transaction policy) apply
        to this load only: Triton's load API with a config override, the repository's config.pbtxt changed so."""
        body: dict = {}
        if parameters or decoupled is not None:
            body = {"parameters": {"config": config_with_parameters(self._config_path(model), parameters or {},
                                                                    decoupled=decoupled)}}
        try:
            status, body = self._request("POST", f"/v2/repository/models/{model}/load", body=body, timeout=timeout)
        except (urllib.error.URLError, TimeoutError, OSError) as e:
            raise TritonServerError(f"loading model '{model}': no answer from the server ({e}); "
                                    f"its log:\n{self.log_tail()}") from None
        if status != 200:
            raise TritonServerError(f"Triton failed to load model '{model}': {body.get('error', body)}")
        if model not in self.loaded:
            self.loaded.append(model)

    def _config_path(self, model: str) -> Path:
        for r in self.repositories:
            if (r / model / "config.pbtxt").exists():
                return r / model / "config.pbtxt"
        raise TritonServerError(f"model '{model}' has no config.pbtxt in {[str(r) for r in self.repositories]}")

    def stop(self, grace: float = 15.0) -> int | None:
        """Stop by PID: SIGTERM, wait, then SIGKILL the server's process group (its stubs). Idempotent."""
        rc = None
        if self.process is not None:
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGTERM)
                try:
                    self.process.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    # the server is a session leader (start_new_session): its group = its stubs
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self.process.pid, signal.SIGKILL)
                    self.process.wait(timeout=10)
            rc = self.process.returncode
            self.process = None
        for region in Path("/dev/shm").glob(f"{self.shm_prefix}*"):
            with contextlib.suppress(OSError):
                region.unlink()
        if self._own_work_dir:  # a temporary directory start() made: backends copy and log
            shutil.rmtree(self.work_dir, ignore_errors=True)
        return rc

    def __enter__(self) -> TritonServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def config_with_parameters(config_pbtxt: Path, parameters: dict[str, str], decoupled: bool | None = None) -> str:
    """A model's config.pbtxt as the JSON Triton's load API accepts, with `parameters` set (string values) and,
    when given, the decoupled transaction policy."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    cfg = text_format.Parse(Path(config_pbtxt).read_text(), model_config_pb2.ModelConfig())
    for k, v in parameters.items():
        cfg.parameters[k].string_value = str(v)
    if decoupled is not None:
        cfg.model_transaction_policy.decoupled = decoupled
    return json_format.MessageToJson(cfg, preserving_proto_field_name=True)


def model_names(repository: Path) -> list[str]:
    """Models of a repository: sub-directories holding a config.pbtxt."""
    return sorted(p.parent.name for p in Path(repository).glob("*/config.pbtxt"))


@dataclass(frozen=True)
class Ports:
    """tritonserver's HTTP, gRPC and metrics ports (None: a free one)."""

    http: int | None = None
    grpc: int | None = None
    metrics: int | None = None


@dataclass(frozen=True)
class ModelLoad:
    """How `start` loads each model: the load timeout, the entries added to its config `parameters` (e.g.
    specpipe_max_batch for the CPU model) and its transaction policy (None: as configured)."""

    timeout: float = 600.0
    parameters: dict[str, str] | None = None
    decoupled: bool | None = None


def start(repositories: list[Path] | Path, *, models: list[str] | None = None, ports: Ports = Ports(),
          work_dir: Path | None = None, ready_timeout: float = 60.0, log_verbose: int = 0,
          load: ModelLoad = ModelLoad(), env: dict[str, str] | None = None) -> TritonServer:
    """Start tritonserver on `repositories`, wait until it is ready, load `models` (default: every model found)
    as `load` says. `env`: variables added to the server's environment (its models' stubs inherit it; e.g. a test
    fault of runtime/serving/faults.py).

    The caller owns the returned server and must `stop()` it (or use it as a context manager). Raises
    TritonServerError (after stopping the server) when startup or a model load fails.
    """
    repos = _repositories(repositories)
    if models is None:
        models = [m for r in repos for m in model_names(r)]
    inst = find_install()
    own = work_dir is None
    wd = Path(tempfile.mkdtemp(prefix="specpipe-triton-")) if own else Path(work_dir)
    wd.mkdir(parents=True, exist_ok=True)
    backends = _backend_dir(inst, wd)
    auto_ports = ports.http is None and ports.grpc is None and ports.metrics is None
    attempts = 3 if auto_ports else 1
    last_error: TritonServerError | None = None
    for _ in range(attempts):
        picked = [ports.http or free_port(), ports.grpc or free_port(), ports.metrics or free_port()]
        srv = _launch(inst, repos, backends, wd, picked, log_verbose, env)
        try:
            srv.wait_ready(ready_timeout)
        except TritonServerError as e:
            srv.stop()
            last_error = e
            if attempts > 1 and "address already in use" in str(e).lower():
                continue  # a port we picked was taken between picking and binding: pick again
            _discard(wd, own)
            raise
        except BaseException:  # Ctrl-C while waiting: never leave a server behind
            _abandon(srv, wd, own)
            raise
        try:
            for m in models:
                srv.load(m, timeout=load.timeout, parameters=load.parameters, decoupled=load.decoupled)
        except BaseException:
            _abandon(srv, wd, own)
            raise
        srv._own_work_dir = own
        return srv
    _discard(wd, own)
    assert last_error is not None
    raise last_error


def _repositories(repositories: list[Path] | Path) -> list[Path]:
    """The model repositories as absolute paths; one that does not exist raises."""
    repos = [Path(r).resolve() for r in ([repositories] if isinstance(repositories, (str, Path)) else repositories)]
    for r in repos:
        if not r.is_dir():
            raise TritonServerError(f"model repository {r} does not exist")
    return repos


def _launch(inst: TritonInstall, repos: list[Path], backends: Path, wd: Path, ports: list[int],
            log_verbose: int, env: dict[str, str] | None = None) -> TritonServer:
    """Spawn tritonserver (its own session, output to its log in `wd`) on the (http, grpc, metrics) `ports`."""
    srv = TritonServer(repositories=repos, http_port=ports[0], grpc_port=ports[1], metrics_port=ports[2],
                       work_dir=wd, log_path=wd / f"tritonserver-{ports[0]}.log",
                       shm_prefix=f"specpipe_{os.getpid()}_{uuid.uuid4().hex[:8]}_")
    cmd = [str(inst.binary), *[f"--model-repository={r}" for r in repos],
           f"--backend-directory={backends}", f"--cache-directory={inst.root / 'caches'}",
           "--model-control-mode=explicit", "--strict-readiness=true",
           "--http-address=127.0.0.1", f"--http-port={srv.http_port}",
           "--grpc-address=127.0.0.1", f"--grpc-port={srv.grpc_port}",
           "--metrics-address=127.0.0.1", f"--metrics-port={srv.metrics_port}",
           "--allow-gpu-metrics=false", "--allow-cpu-metrics=true", "--pinned-memory-pool-byte-size=0",
           "--exit-timeout-secs=5", f"--log-verbose={log_verbose}",
           f"--backend-config=python,shm-region-prefix-name={srv.shm_prefix}"]
    with open(srv.log_path, "wb") as log:
        srv.process = subprocess.Popen(cmd, env=_env(inst, env), stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
    return srv


def _discard(wd: Path, own: bool) -> None:
    """Remove the work directory when start() made it (a temporary one)."""
    if own:
        shutil.rmtree(wd, ignore_errors=True)


def _abandon(srv: TritonServer, wd: Path, own: bool) -> None:
    """A start that failed: stop the server and remove the work directory start() made."""
    srv.stop()
    _discard(wd, own)
