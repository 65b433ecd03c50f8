"""`specpipe` command line. The only module that touches argv, terminal formatting and exit codes.

Exit codes: 0 success, 1 a stage failed (or the workdir is locked), 2 usage or config error.
"""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import click

from pipeline.errors import ConfigError, SpecpipeError, UsageError
from runtime.errors import RuntimeFailure, RuntimeUsageError

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def _setup_logging(level: str = "info") -> None:
    root = logging.getLogger("specpipe")
    if root.handlers:
        return
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    root.addHandler(h)
    root.setLevel(level.upper())


def _default_workdir(config: str) -> Path:
    return Path("runs") / Path(config).stem


def _existing_workdir(workdir: str | None) -> Path:
    """--workdir, or the only run under ./runs (what `specpipe build CONFIG` made by default)."""
    if workdir is None:
        runs = sorted(Path("runs").glob("*/last_build.json")) if Path("runs").exists() else []
        if len(runs) != 1:
            found = f" (found {len(runs)}: {', '.join(str(r.parent) for r in runs[:5])})" if runs else ""
            _fail(UsageError(f"give --workdir: the default is the only run under ./runs{found}"))
        return runs[0].parent
    if not Path(workdir).is_dir():
        _fail(UsageError(f"--workdir {workdir}: no such directory"))
    return Path(workdir)


def _load(config: str, overrides: tuple[str, ...]):
    from pipeline.config import load_config

    return load_config(config, list(overrides))


def _fail(e: SpecpipeError | RuntimeFailure) -> None:
    if isinstance(e, ConfigError):
        click.echo(f"config error{' in ' + e.source if e.source else ''}:", err=True)
        for line in e.lines():
            click.echo(f"  {line}", err=True)
        sys.exit(EXIT_USAGE)
    if isinstance(e, (UsageError, RuntimeUsageError)):
        click.echo(f"error: {e}", err=True)
        sys.exit(EXIT_USAGE)
    click.echo(f"error: {e}", err=True)
    sys.exit(EXIT_FAILED)


config_arg = click.argument("config", type=click.Path(dir_okay=False))
override_opt = click.option("-o", "--override", "overrides", multiple=True, metavar="SECTION.FIELD=VALUE",
                            help="override a config field (repeatable), validated like the file")
workdir_opt = click.option("--workdir", type=click.Path(file_okay=False), default=None,
                           help="where artifacts live (default: runs/<config file stem>)")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="specpipe")
def cli() -> None:
    """specpipe: from a target LLM to a verified FP8 speculative-decoding deployment."""


@cli.command()
@config_arg
@workdir_opt
@override_opt
@click.option("--only", default=None, metavar="STAGE", help="run this stage only (its inputs must be up to date)")
@click.option("--from", "from_", default=None, metavar="STAGE", help="run from this stage on")
@click.option("--force", multiple=True, metavar="STAGE|all", help="rerun this stage even if up to date (repeatable)")
def build(config, workdir, overrides, only, from_, force):
    """Run every stage that is not up to date, in order."""
    from pipeline import runner
    from pipeline.store import Store

    try:
        cfg = _load(config, overrides)
        _setup_logging(cfg.run.log_level)
        store = Store(Path(workdir) if workdir else _default_workdir(config))
        outcomes = runner.build(cfg, store, argv=["specpipe", *sys.argv[1:]], config_path=config,
                                only=only, from_=from_, force=tuple(force))
    except SpecpipeError as e:
        _fail(e)
        return
    except KeyboardInterrupt:
        click.echo("interrupted: nothing half-written was committed; run the same command to resume", err=True)
        sys.exit(130)
    _print_outcomes(outcomes, store)
    failed = [o for o in outcomes if o.action == "failed"]
    if failed:
        o = failed[0]
        click.echo(f"stage '{o.name}' failed: {o.error}\n  log: {o.log_file}", err=True)
        sys.exit(EXIT_FAILED)


def _print_outcomes(outcomes, store) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"specpipe build: {store.root}")
    for c in ("stage", "action", "reason", "time"):
        t.add_column(c)
    colors = {"ran": "green", "skip": "dim", "failed": "red", "blocked": "yellow", "disabled": "dim", "excluded": "dim"}
    for o in outcomes:
        t.add_row(o.name, f"[{colors.get(o.action, '')}]{o.action}[/]", o.reason,
                  f"{o.wall_s:.1f}s" if o.action in ("ran", "failed") else "")
    Console(stderr=True, width=160).print(t)


@cli.command()
@config_arg
@workdir_opt
@override_opt
@click.option("--only", default=None, metavar="STAGE")
@click.option("--from", "from_", default=None, metavar="STAGE")
@click.option("--force", multiple=True, metavar="STAGE|all")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def plan(config, workdir, overrides, only, from_, force, as_json):
    """Show what `build` would run and why, without running anything."""
    from pipeline import runner
    from pipeline.store import Store

    try:
        cfg = _load(config, overrides)
        store = Store(Path(workdir) if workdir else _default_workdir(config))
        items = runner.make_plan(cfg, store, only=only, from_=from_, force=tuple(force))
    except SpecpipeError as e:
        _fail(e)
        return
    if as_json:
        click.echo(json.dumps([{"stage": i.name, "action": i.action, "reason": i.reason,
                                "fingerprint": i.fingerprint} for i in items], indent=2))
        return
    for i in items:
        click.echo(f"{i.name:12s} {i.action:9s} {i.reason}")


@cli.command()
@config_arg
@override_opt
def check(config, overrides):
    """Validate a config (and overrides) without running anything."""
    try:
        cfg = _load(config, overrides)
    except SpecpipeError as e:
        _fail(e)
        return
    from pipeline import registry

    on = [s.name for s in registry.stages() if getattr(cfg, s.name).enabled]
    click.echo(f"{config}: OK ({len(on)} stages enabled: {', '.join(on)})")


@cli.command()
@workdir_opt
@click.option("--json", "as_json", is_flag=True, help="stable machine-readable summary (shape in README)")
@click.option("--verify", is_flag=True, help="also re-hash every committed file against its manifest")
def status(workdir, as_json, verify):
    """Each stage's state, fingerprint, timings and metrics."""
    from pipeline import runner
    from pipeline.store import Store

    wd = _existing_workdir(workdir)
    store = Store(wd)
    doc = runner.status(store)
    if verify:
        for st in doc["stages"]:
            if st["state"] == "committed":
                st["verify"] = store.verify(st["name"]) or "ok"
    if as_json:
        click.echo(json.dumps(doc, indent=2, default=str))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"specpipe status: {wd}")
    for c in ("stage", "state", "fingerprint", "wall", "peak RSS", "key metrics"):
        t.add_column(c)
    for st in doc["stages"]:
        metrics = ", ".join(f"{k}={_short(v)}" for k, v in list(st["metrics"].items())[:4] if not isinstance(v, (dict, list)))
        t.add_row(st["name"], st["state"], (st["fingerprint"] or "")[:12],
                  f"{st['wall_time_s']:.1f}s" if st["wall_time_s"] is not None else "",
                  f"{st['peak_rss_mb']:.0f} MB" if st["peak_rss_mb"] is not None else "", metrics)
    Console(width=180).print(t)


def _short(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


@cli.command()
@workdir_opt
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="default: <workdir>/report.html")
def report(workdir, out):
    """Write a self-contained HTML report of the run."""
    from pipeline.report import write_report
    from pipeline.store import Store

    path = write_report(Store(_existing_workdir(workdir)), Path(out) if out else None)
    click.echo(str(path))


@cli.command()
@workdir_opt
@click.option("--http-port", type=click.IntRange(1, 65535), default=None, help="default: a free port")
@click.option("--grpc-port", type=click.IntRange(1, 65535), default=None, help="default: a free port")
@click.option("--metrics-port", type=click.IntRange(1, 65535), default=None, help="default: a free port")
@click.option("--ready-timeout", type=float, default=300.0, show_default=True, help="seconds to wait for the model to load")
@click.option("--max-batch", type=click.IntRange(1), default=None,
              help="most requests decoding together (continuous batching; the model's default: 8)")
@click.option("--max-queue", type=click.IntRange(0), default=None,
              help="most requests waiting for a slot; beyond it a request gets an 'overloaded' error (default: 32)")
@click.option("--draft-len", type=click.IntRange(0), default=None,
              help="draft tokens per step (default: the exported one; 0 serves the target without speculation)")
@click.option("--decoupled/--not-decoupled", default=None,
              help="override the exported transaction policy (HTTP infer clients such as perf_analyzer -i http "
                   "need --not-decoupled; streaming needs decoupled)")
def serve(workdir, http_port, grpc_port, metrics_port, ready_timeout, max_batch, max_queue, draft_len, decoupled):
    """Serve the exported CPU Triton repository (FP8 target + draft) on 127.0.0.1 until Ctrl-C."""
    import time

    from runtime.serving import triton_server

    wd = Path(workdir) if workdir else None
    if wd is None:
        runs = sorted(Path("runs").glob("*/artifacts/export/triton_cpu")) if Path("runs").exists() else []
        if len(runs) != 1:
            _fail(UsageError("give --workdir (default only when exactly one run under ./runs has an export)"))
        wd = runs[0].parents[2]
    repo = wd / "artifacts" / "export" / "triton_cpu"
    if not (wd / "artifacts" / "export" / "manifest.json").exists() or not repo.is_dir():
        _fail(UsageError(f"{wd}: no committed export with a CPU repository; run `specpipe build <config>` first"))
    click.echo(f"starting Triton on {repo} ...", err=True)
    try:
        params = {k: str(v) for k, v in (("specpipe_max_batch", max_batch), ("specpipe_max_queue", max_queue),
                                         ("specpipe_draft_len", draft_len)) if v is not None}
        srv = triton_server.start(repo, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
                                  load_timeout=ready_timeout, model_parameters=params or None, decoupled=decoupled)
    except (SpecpipeError, RuntimeFailure) as e:
        _fail(e)
        return
    name = srv.loaded[0] if srv.loaded else "tensorrt_llm"
    click.echo(f"Triton {', '.join(srv.loaded)} ready (pid {srv.pid})\n"
               f"  HTTP     http://{srv.http_url}\n  gRPC     {srv.grpc_url}\n  metrics  {srv.metrics_url}\n"
               f"  try: curl -s http://{srv.http_url}/v2/models/{name}/generate -d "
               "'{\"text_input\": \"def add(a, b):\", \"sampling_param_max_tokens\": 32, "
               "\"sampling_param_return_perf_metrics\": true}'\n"
               f"  log: {srv.log_path}\nCtrl-C stops it.")
    import signal

    def _term(*_):  # `kill <pid>` stops the server too, the same way as Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)
    signal.signal(signal.SIGINT, _term)   # also when started with SIGINT ignored (a background job of a script)
    try:
        while srv.alive():
            time.sleep(0.5)
        click.echo(f"error: tritonserver exited with code {srv.process.returncode}:\n{srv.log_tail()}", err=True)
        srv.stop()
        sys.exit(EXIT_FAILED)
    except KeyboardInterrupt:
        click.echo("stopping Triton ...", err=True)
        rc = srv.stop()
        click.echo(f"stopped (exit code {rc})", err=True)


@cli.command()
@click.option("--workdir", type=click.Path(file_okay=False), default=None,
              help="the run whose validated pair is deployed (default: the only run under ./runs)")
@click.option("--url", default=None, help="the endpoint's HTTP address, e.g. http://127.0.0.1:8000 (active probes)")
@click.option("--model", default=None, help="model name (default: the export's, tensorrt_llm)")
@click.option("--passive", is_flag=True, help="read the CPU model's Prometheus counters instead of probing")
@click.option("--metrics-url", default=None, help="Triton's metrics URL, e.g. http://127.0.0.1:8002/metrics (--passive)")
@click.option("--once", is_flag=True, help="one round, then exit: 1 on a drift alarm or a failed probe (for cron)")
@click.option("--interval", type=click.FloatRange(0), default=300.0, show_default=True, help="seconds between rounds")
@click.option("--probes", type=click.IntRange(1), default=None, help="stop after this many rounds (default: run until Ctrl-C)")
@click.option("--draft-len", type=click.IntRange(1), default=None, help="deployed draft length (default: build's, at batch 1)")
@click.option("--drop", type=click.FloatRange(0.01, 0.99), default=0.2, show_default=True,
              help="relative AL drop the test is designed to detect (alarm boundary: half of it)")
@click.option("--false-alarm", type=click.FloatRange(1e-12, 0.5), default=1e-3, show_default=True,
              help="designed false alarms per probe and domain (CUSUM threshold ln(1/x))")
@click.option("--dispersion", type=click.FloatRange(1.0), default=2.0, show_default=True,
              help="variance inflation for correlated steps within a response")
@click.option("--prompts-per-probe", type=click.IntRange(1), default=None,
              help="prompts per domain and round (default: the ones validate measured)")
@click.option("--timeout", type=click.FloatRange(1), default=120.0, show_default=True, help="seconds per probe request")
@click.option("--prom-file", type=click.Path(dir_okay=False), default=None,
              help="Prometheus text file (default: <workdir>/monitor/specpipe_monitor-<endpoint>.prom)")
@click.option("--state", "state_file", type=click.Path(dir_okay=False), default=None,
              help="CUSUM state across runs (default: <workdir>/monitor/state-<endpoint>.json)")
@click.option("--reset", is_flag=True, help="forget the accumulated evidence")
def monitor(workdir, url, model, passive, metrics_url, once, interval, probes, draft_len, drop, false_alarm, dispersion,
            prompts_per_probe, timeout, prom_file, state_file, reset):
    """Watch a live endpoint's acceptance against validate's baseline (draft drift): a sequential test per
    domain, an alarm line, a Prometheus text file."""
    import hashlib
    import time

    from pipeline import monitor as M

    wd = _existing_workdir(workdir)
    if passive and not metrics_url:
        _fail(UsageError("--passive reads Triton's metrics: give --metrics-url http://HOST:PORT/metrics"))
    if not passive and not url:
        _fail(UsageError("give --url (the endpoint to probe) or --passive --metrics-url"))
    try:
        run = M.read_run(wd, draft_len=draft_len, prompts_per_probe=prompts_per_probe)
        if model:
            run.model_name = model
        design = M.Design(draft_len=run.draft_len, drop=drop, false_alarm=false_alarm, dispersion=dispersion)
        target = metrics_url if passive else url
        tag = hashlib.sha256(f"{target}|{run.model_name}".encode()).hexdigest()[:10]
        mon = M.Monitor(run, design, url=url, metrics_url=metrics_url, passive=passive,
                        state_path=Path(state_file) if state_file else wd / "monitor" / f"state-{tag}.json",
                        prom_path=Path(prom_file) if prom_file else wd / "monitor" / f"specpipe_monitor-{tag}.prom",
                        timeout=timeout, reset=reset, echo=click.echo)
    except SpecpipeError as e:
        _fail(e)
        return
    click.echo(mon.describe())
    raised = False
    n = 0
    try:
        while True:
            try:
                alarms = mon.step()
            except M.ProbeError as e:
                click.echo(f"probe failed: {e}", err=True)
                if once:
                    sys.exit(EXIT_FAILED)
                alarms = []
            raised = raised or bool(alarms)
            n += 1
            if once:
                missing = [d for d, t in mon.tests.items() if t.missing_stats]
                sys.exit(EXIT_FAILED if alarms or missing else EXIT_OK)
            if probes is not None and n >= probes:
                break
            time.sleep(interval)
    except KeyboardInterrupt:
        click.echo("stopped", err=True)
    click.echo(f"{n} round(s); {'drift alarm raised' if raised else 'no drift alarm'}; prometheus file: {mon.prom_path}")
    sys.exit(EXIT_FAILED if raised else EXIT_OK)


def _profile_shapes(cfg, artifacts: Path):
    """The shapes `specpipe profile` measures: the committed target's (and draft's, once trained), else, for the
    built-in tiny target, its config section's. UsageError when neither is available."""
    from pipeline.artifacts import target as target_artifact
    from pipeline.artifacts import train_draft as train_draft_artifact
    from runtime.cost import profile as P
    from runtime.cost.costmodel import llama

    tart, dart = artifacts / "target", artifacts / "train_draft"
    if (tart / "manifest.json").is_file() and (tart / target_artifact.INFO).is_file():
        tinfo, src = target_artifact.read_info(tart), str(tart / target_artifact.INFO)
        draft = dcfg = None
        if (dart / "manifest.json").is_file() and (dart / train_draft_artifact.INFO).is_file() \
                and (train_draft_artifact.draft_dir(dart) / "config.json").is_file():
            draft, dcfg = train_draft_artifact.read_info(dart), train_draft_artifact.read_draft_config(dart)
            src += f", {dart / train_draft_artifact.INFO}"
        return P.shapes_from_artifacts(tinfo, draft, dcfg), src
    if cfg.target.bootstrap == "tiny":
        t = cfg.target.tiny
        return {"target": llama("target", num_layers=t.num_layers, hidden=t.hidden_size, heads=t.num_heads,
                                kv_heads=t.num_kv_heads, intermediate=t.intermediate_size, vocab=t.vocab_size)}, \
            "target.tiny (no target artifact yet)"
    raise UsageError(f"no committed target artifact in {artifacts}: run `specpipe build CONFIG --only target` "
                     "first (the profile measures the target's layer shapes)")


@cli.command()
@config_arg
@workdir_opt
@override_opt
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="default: <workdir>/hardware_profile.json")
@click.option("--rows", default="1,2,4,8,16,32,64,128,256", show_default=True, help="token rows M to measure (comma-separated)")
@click.option("--context", type=click.IntRange(1), default=512, show_default=True, help="KV length each sequence attends to")
@click.option("--rounds", type=click.IntRange(1), default=3, show_default=True, help="repeat everything; keep each best")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "fp8"]), default="auto", show_default=True,
              help="GEMM dtype (auto: fp8 on FP8 GPUs, bfloat16 on other GPUs, float32 on a CPU)")
def profile(config, workdir, overrides, out, rows, context, rounds, dtype):
    """Measure the target's (and draft's) step time on this machine, fit the cost model, write a profile
    that `hardware.profile` can use instead of datasheet numbers."""
    from pipeline.store import Store
    from runtime.cost import profile as P

    try:
        cfg = _load(config, overrides)
        try:
            ms = sorted({int(x) for x in rows.split(",") if x.strip()})
        except ValueError:
            raise UsageError(f"--rows {rows}: expected comma-separated integers") from None
        if not ms or ms[0] < 1:
            raise UsageError(f"--rows {rows}: expected positive integers")
        store = Store(Path(workdir) if workdir else _default_workdir(config))
        shapes, source = _profile_shapes(cfg, store.root / "artifacts")
        device, gemm_dtype = P.resolve_device_dtype(cfg.run.device, dtype)
        import torch

        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        click.echo(f"profiling {', '.join(shapes)} ({source}) on {P.device_name(device)}, {gemm_dtype} GEMMs, "
                   f"{torch.get_num_threads()} threads, context {context}, {rounds} round(s)", err=True)
        doc = P.profile(shapes, device=device, gemm_dtype=gemm_dtype, rows=ms, context=context, rounds=rounds,
                        progress=lambda r, key, q, m, t: click.echo(
                            f"  round {r + 1} {key} M={m:<5d} q={q} {t * 1e3:9.3f} ms", err=True))
    except (SpecpipeError, RuntimeFailure) as e:
        _fail(e)
        return
    path = Path(out) if out else store.root / "hardware_profile.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2))
    m = doc["machine"]
    click.echo(f"machine: GEMM {m['peak_tflops'][gemm_dtype] * 1e3:.1f} GFLOP/s, {m['bandwidth_tb_s'] * 1e3:.1f} GB/s "
               f"(cache {m['cache_bandwidth_tb_s'] * 1e3:.1f}), attention {m['attn_bandwidth_tb_s'] * 1e3:.1f} GB/s / "
               f"{m['attn_tflops'] * 1e3:.1f} GFLOP/s, overlap p={m['overlap']:.2f}, {m['op_overhead_us']:.1f} us/op; "
               f"ridge {doc['ridge_rows']:.1f} rows")
    click.echo("weight streaming by working set: " + ", ".join(
        f"{w / 2**20:.0f} MiB {b * 1e3:.1f} GB/s" for w, b in m.get("footprint_bandwidth_tb_s") or []))
    click.echo("GEMM time factor by rows: " + ", ".join(f"M={r} {f:.2f}" for r, f in m.get("gemm_row_factors") or []))
    for key, mod in doc["models"].items():
        click.echo(f"{key}: {'M':>5s} {'q':>2s} {'measured ms':>12s} {'predicted ms':>13s} {'error':>7s}")
        for p in mod["points"]:
            click.echo(f"{'':{len(key) + 1}s} {p['rows']:5d} {p['q_len']:2d} {p['measured_ms']:12.3f} "
                       f"{p['predicted_ms']:13.3f} {100 * p['error']:+6.1f}%")
        click.echo(f"{key}: mean |error| {100 * mod['mean_abs_error']:.1f}%, max {100 * mod['max_abs_error']:.1f}%")
    click.echo(f"wrote {path}\nuse it: hardware.profile: {path}")


@cli.command()
@config_arg
@workdir_opt
@override_opt
@click.option("--image", default=None, help="container image for srun --container-image (pyxis/enroot), e.g. the pipeline image; "
                                            "without it, srun runs this environment's specpipe")
@click.option("--nodes", type=click.IntRange(1), default=1, show_default=True)
@click.option("--gpus-per-node", type=click.IntRange(0), default=8, show_default=True, help="0 for a CPU allocation (the "
                                                                                            "config's launcher is kept)")
@click.option("--time", "time_", default="24:00:00", show_default=True, help="wall-clock limit")
@click.option("--partition", default=None)
@click.option("--account", default=None)
@click.option("--mount", "mounts", multiple=True, metavar="SRC:DST", help="container mount (repeatable); the workdir must be "
                                                                          "visible on every node")
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="default: <workdir>/slurm/specpipe.sbatch")
@click.option("--submit", is_flag=True, help="submit the script with sbatch")
def slurm(config, workdir, overrides, image, nodes, gpus_per_node, time_, partition, account, mounts, out, submit):
    """Write an sbatch script that runs the pipeline (in a container with --image) on one node or several."""
    import shutil
    import subprocess

    from pipeline.slurm import SlurmJob, render

    try:
        cfg = _load(config, overrides)
    except SpecpipeError as e:
        _fail(e)
        return
    wd = str(Path(workdir) if workdir else _default_workdir(config))
    if any(c in wd for c in '"\n'):
        _fail(UsageError(f"--workdir {wd!r}: a path with quotes or newlines cannot go into an #SBATCH line"))
    job = SlurmJob(config=str(Path(config).resolve()), workdir=str(Path(wd).resolve()), image=image, nodes=nodes,
                   gpus_per_node=gpus_per_node, time=time_,
                   partition=partition, account=account, mounts=list(mounts), overrides=list(overrides))
    path = Path(out) if out else Path(wd) / "slurm" / "specpipe.sbatch"
    path.parent.mkdir(parents=True, exist_ok=True)
    (Path(job.workdir) / "logs").mkdir(parents=True, exist_ok=True)   # Slurm opens --output before the script runs
    path.write_text(render(cfg, job))
    path.chmod(0o755)
    click.echo(str(path))
    if submit:
        sbatch = shutil.which("sbatch")
        if sbatch is None:
            _fail(UsageError(f"--submit: sbatch is not on PATH here; on a Slurm login node run: sbatch {path}"))
        r = subprocess.run([sbatch, str(path)], capture_output=True, text=True)
        click.echo(r.stdout.strip() or r.stderr.strip(), err=r.returncode != 0)
        if r.returncode != 0:
            sys.exit(EXIT_FAILED)


def main() -> None:
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(EXIT_USAGE)
    except SystemExit:
        raise


if __name__ == "__main__":
    main()
