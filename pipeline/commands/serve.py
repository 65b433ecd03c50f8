"""`specpipe serve`: the exported CPU Triton repository found, started on 127.0.0.1, and kept running until
Ctrl-C or `kill`."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.commands import stop_signals
from pipeline.errors import UsageError


def find_repository(workdir: str | None) -> Path:
    """The committed export's triton_cpu/ of --workdir, or of the only run under ./runs that has one."""
    wd = Path(workdir) if workdir else None
    if wd is None:
        runs = sorted(Path("runs").glob("*/artifacts/export/triton_cpu")) if Path("runs").exists() else []
        if len(runs) != 1:
            raise UsageError("give --workdir (default only when exactly one run under ./runs has an export)")
        wd = runs[0].parents[2]
    repo = wd / "artifacts" / "export" / "triton_cpu"
    if not (wd / "artifacts" / "export" / "manifest.json").exists() or not repo.is_dir():
        raise UsageError(f"{wd}: no committed export with a CPU repository; run `specpipe build <config>` first")
    return repo


@dataclass(frozen=True)
class ServeOptions:
    """`specpipe serve`'s command line (pipeline/cli.py documents each option)."""

    workdir: str | None = None
    engine: str = "triton"
    http_port: int | None = None
    grpc_port: int | None = None
    metrics_port: int | None = None
    ready_timeout: float = 300.0
    max_batch: int | None = None
    max_queue: int | None = None
    draft_len: int | None = None
    decoupled: bool | None = None
    vllm_target: str = "auto"
    vllm_python: str | None = None
    kv_cache_gib: float = 2.0


def start(repo: Path, o: ServeOptions):
    """tritonserver on `repo`, waited for until the model is ready; the specpipe_* model parameters given."""
    from runtime.serving import triton_server

    params = {k: str(v) for k, v in (("specpipe_max_batch", o.max_batch), ("specpipe_max_queue", o.max_queue),
                                     ("specpipe_draft_len", o.draft_len)) if v is not None}
    return triton_server.start(repo, ports=triton_server.Ports(o.http_port, o.grpc_port, o.metrics_port),
                               load=triton_server.ModelLoad(o.ready_timeout, params or None, o.decoupled))


def ready_message(srv) -> str:
    name = srv.loaded[0] if srv.loaded else "tensorrt_llm"
    return (f"Triton {', '.join(srv.loaded)} ready (pid {srv.pid})\n"
            f"  HTTP     http://{srv.http_url}\n  gRPC     {srv.grpc_url}\n  metrics  {srv.metrics_url}\n"
            f"  try: curl -s http://{srv.http_url}/v2/models/{name}/generate -d "
            "'{\"text_input\": \"def add(a, b):\", \"sampling_param_max_tokens\": 32, "
            "\"sampling_param_return_perf_metrics\": true}'\n"
            f"  log: {srv.log_path}\nCtrl-C stops it.")


def run_until_stopped(srv, echo, what: str = "tritonserver") -> bool:
    """Keep the server running until Ctrl-C or SIGTERM (then stop it: True) or until it exits by itself (its log
    tail is echoed: False)."""
    import time

    stop_signals()
    try:
        while srv.alive():
            time.sleep(0.5)
        echo(f"error: {what} exited with code {srv.process.returncode}:\n{srv.log_tail()}", err=True)
        srv.stop()
        return False
    except KeyboardInterrupt:
        echo(f"stopping {what} ...", err=True)
        rc = srv.stop()
        echo(f"stopped (exit code {rc})", err=True)
        return True
