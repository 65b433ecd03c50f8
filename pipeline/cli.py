"""`specpipe` command line. The only module that touches argv and exit codes: it parses the arguments, calls the
subcommand's body (pipeline/commands/<subcommand>.py where it is more than a few lines) and turns its result and
the project's errors into output and an exit code.

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
keep_opt = click.option("--keep", multiple=True, metavar="STAGE", help="accept this stage's committed artifact across a "
                        "code change (only its code differs; recorded in its provenance; repeatable)")
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
@keep_opt
def build(config, workdir, overrides, only, from_, force, keep):
    """Run every stage that is not up to date, in order."""
    from pipeline import runner
    from pipeline.commands import stop_signals
    from pipeline.store import Store

    stop_signals()      # SIGTERM unwinds like Ctrl-C: started servers stopped, the stage in progress not committed
    try:
        cfg = _load(config, overrides)
        _setup_logging(cfg.run.log_level)
        store = Store(Path(workdir) if workdir else _default_workdir(config))
        outcomes = runner.build(cfg, store, argv=["specpipe", *sys.argv[1:]], config_path=config,
                                only=only, from_=from_, force=tuple(force), keep_=tuple(keep))
    except SpecpipeError as e:
        _fail(e)
        return
    except KeyboardInterrupt:
        click.echo("interrupted: nothing half-written was committed; run the same command to resume", err=True)
        sys.exit(130)
    from pipeline.commands.build import print_outcomes

    print_outcomes(outcomes, store)
    failed = [o for o in outcomes if o.action == "failed"]
    if failed:
        o = failed[0]
        click.echo(f"stage '{o.name}' failed: {o.error}\n  log: {o.log_file}", err=True)
        sys.exit(EXIT_FAILED)


@cli.command()
@config_arg
@workdir_opt
@override_opt
@click.option("--only", default=None, metavar="STAGE")
@click.option("--from", "from_", default=None, metavar="STAGE")
@click.option("--force", multiple=True, metavar="STAGE|all")
@keep_opt
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def plan(config, workdir, overrides, only, from_, force, keep, as_json):
    """Show what `build` would run and why, without running anything."""
    from pipeline import runner
    from pipeline.store import Store

    try:
        cfg = _load(config, overrides)
        store = Store(Path(workdir) if workdir else _default_workdir(config))
        items = runner.make_plan(cfg, store, only=only, from_=from_, force=tuple(force), keep_=tuple(keep))
    except SpecpipeError as e:
        _fail(e)
        return
    if as_json:
        click.echo(json.dumps([{"stage": i.name, "action": i.action, "reason": i.reason, "fingerprint": i.fingerprint,
                                "code_changes": i.code_changes} for i in items], indent=2))
        return
    for i in items:
        click.echo(f"{i.name:12s} {i.action:9s} {i.reason}")
        for c in i.code_changes[:8]:    # which file changed, and the import chain by which the stage reaches it
            click.echo(f"{'':22s} {c['file']}: " + (" -> ".join(c["via"]) if c["via"] else "no longer reached"))
        if len(i.code_changes) > 8:
            click.echo(f"{'':22s} (+{len(i.code_changes) - 8} more files: --json lists them)")


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
    from pipeline.commands import status as C

    wd = _existing_workdir(workdir)
    doc = C.collect(wd, verify)
    if as_json:
        click.echo(json.dumps(doc, indent=2, default=str))
        return
    C.print_table(doc, wd)


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
@click.option("--engine", type=click.Choice(["triton", "vllm"]), default="triton", show_default=True,
              help="triton: the exported CPU Triton repository; vllm: the exported speculators pair in vLLM (OpenAI API)")
@click.option("--http-port", type=click.IntRange(1, 65535), default=None, help="default: a free port")
@click.option("--grpc-port", type=click.IntRange(1, 65535), default=None, help="default: a free port (triton)")
@click.option("--metrics-port", type=click.IntRange(1, 65535), default=None, help="default: a free port (triton)")
@click.option("--ready-timeout", type=float, default=300.0, show_default=True, help="seconds to wait for the model to load")
@click.option("--max-batch", type=click.IntRange(1), default=None,
              help="most requests decoding together (continuous batching; the model's default: 8) (triton)")
@click.option("--max-queue", type=click.IntRange(0), default=None,
              help="most requests waiting for a slot; beyond it a request gets an 'overloaded' error (default: 32) (triton)")
@click.option("--draft-len", type=click.IntRange(0), default=None,
              help="draft tokens per step (default: the exported one; 0 serves the target without speculation)")
@click.option("--decoupled/--not-decoupled", default=None,
              help="override the exported transaction policy (HTTP infer clients such as perf_analyzer -i http "
                   "need --not-decoupled; streaming needs decoupled) (triton)")
@click.option("--target", "vllm_target", type=click.Choice(["auto", "bf16", "fp8"]), default="auto", show_default=True,
              help="vllm: which target (auto: FP8 on CUDA, BF16 on CPU, where vLLM cannot run the FP8 target)")
@click.option("--vllm-python", default=None, help="vllm: the python of vLLM's environment (default: $SPECPIPE_VLLM_PYTHON, "
              "<repo>/.venv-vllm, the python of `vllm` on PATH)")
@click.option("--kv-cache-gib", type=click.FloatRange(0.5), default=2.0, show_default=True, help="vllm on CPU: KV cache size")
def serve(**options):
    """Serve the run's export on 127.0.0.1 until Ctrl-C: the CPU Triton repository (FP8 target + draft), or with
    --engine vllm the speculators pair in vLLM, OpenAI-compatible."""
    from pipeline.commands import serve as C

    o = C.ServeOptions(**options)
    if o.engine == "vllm":
        _serve_vllm(o)
        return
    try:
        repo = C.find_repository(o.workdir)
    except UsageError as e:
        _fail(e)
        return
    click.echo(f"starting Triton on {repo} ...", err=True)
    try:
        srv = C.start(repo, o)
    except (SpecpipeError, RuntimeFailure) as e:
        _fail(e)
        return
    click.echo(C.ready_message(srv))
    if not C.run_until_stopped(srv, click.echo):
        sys.exit(EXIT_FAILED)


def _serve_vllm(o) -> None:
    from pipeline.commands import serve as C
    from pipeline.commands import serve_vllm as V
    from pipeline.commands import stop_signals

    try:
        install = V.find_install(o.vllm_python)
        pair = V.find_pair(o.workdir, target=o.vllm_target, device=install.device, draft_len=o.draft_len)
    except UsageError as e:
        _fail(e)
        return
    click.echo(f"starting vLLM {install.version} ({install.device}) on {pair.target} ...", err=True)
    stop_signals()
    try:
        srv = V.start(install, pair, port=o.http_port, ready_timeout=o.ready_timeout, kv_cache_gib=o.kv_cache_gib)
    except (SpecpipeError, RuntimeFailure) as e:
        _fail(e)
        return
    except KeyboardInterrupt:   # VllmServer.start stopped the half-started server
        click.echo("interrupted while vLLM was starting: stopped", err=True)
        sys.exit(EXIT_FAILED)
    click.echo(V.ready_message(srv, pair))
    if not C.run_until_stopped(srv, click.echo, what="vllm serve"):
        sys.exit(EXIT_FAILED)


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
@click.option("--engine", type=click.Choice(["triton", "vllm", "trtllm", "trtllm-json", "sglang"]), default="triton",
              show_default=True,
              help="vllm: a vLLM server (OpenAI completions probes; its vllm:spec_decode_* counters, --metrics-url "
                   "defaulting to <url>/metrics); with --passive: trtllm (trtllm-serve's /prometheus/metrics), "
                   "trtllm-json (its JSON /metrics iteration stats), sglang (SGLang's /metrics)")
@click.option("--traffic", is_flag=True,
              help="beside the active probes (the canary), test the engine's counters between rounds (the live "
                   "traffic, probes left out); the diagnosis tells engine state from traffic drift")
@click.option("--served-target", type=click.Path(file_okay=False), default=None,
              help="the target directory the endpoint serves, hashed and compared with export.json (vLLM: default its "
                   "/v1/models root when readable here)")
@click.option("--served-draft", type=click.Path(file_okay=False), default=None,
              help="the draft directory the endpoint serves, compared with export.json")
def monitor(**options):
    """Watch a live endpoint's acceptance against validate's baseline (draft drift): a sequential test per
    domain, an alarm line, a Prometheus text file."""
    from pipeline.commands import monitor as C

    o = C.MonitorOptions(**options)
    wd = _existing_workdir(o.workdir)
    if o.passive and not o.metrics_url and not (o.engine == "vllm" and o.url):
        _fail(UsageError("--passive reads the server's metrics: give --metrics-url http://HOST:PORT/metrics"))
    if not o.passive and not o.url:
        _fail(UsageError("give --url (the endpoint to probe) or --passive --metrics-url"))
    try:
        mon = C.open_monitor(wd, o, echo=click.echo)
    except SpecpipeError as e:
        _fail(e)
        return
    click.echo(mon.describe())
    out = C.watch(mon, once=o.once, probes=o.probes, interval=o.interval, echo=click.echo)
    if out.once_ok is not None:
        sys.exit(EXIT_OK if out.once_ok else EXIT_FAILED)
    click.echo(f"{out.rounds} round(s); {'drift alarm raised' if out.raised else 'no drift alarm'}; "
               f"prometheus file: {mon.prom_path}")
    sys.exit(EXIT_FAILED if out.raised else EXIT_OK)


@cli.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--overheads", type=click.Choice(["fitted", "none", "refit"]), default="fitted", show_default=True,
              help="engine overheads: the fitted constants, none (the model as tune prices), or fitted on FILE's fit set")
@click.option("--json", "as_json", is_flag=True, help="every run's prediction, published figures and errors as JSON")
def predict(file, overheads, as_json):
    """The cost model against published GPU runs (FILE: bench/published_runs.yaml or one in its schema):
    predicted plain and speculative tokens/s and speedup beside the published ones, and the error."""
    from pipeline.commands import predict as C

    try:
        doc = C.compare(file, overheads)
    except RuntimeFailure as e:
        _fail(e)
        return
    if as_json:
        click.echo(json.dumps(doc, indent=2))
        return
    C.print_table(doc)


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
    from pipeline.commands import profile as C
    from pipeline.store import Store

    try:
        cfg = _load(config, overrides)
        ms = C.parse_rows(rows)
        store = Store(Path(workdir) if workdir else _default_workdir(config))
        doc, gemm_dtype = C.measure(cfg, store.root / "artifacts", rows=ms, context=context, rounds=rounds, dtype=dtype,
                                    echo=click.echo)
    except (SpecpipeError, RuntimeFailure) as e:
        _fail(e)
        return
    path = Path(out) if out else store.root / "hardware_profile.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2))
    for line in C.summary(doc, gemm_dtype):
        click.echo(line)
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
@click.option("--time", default="24:00:00", show_default=True, help="wall-clock limit")
@click.option("--partition", default=None)
@click.option("--account", default=None)
@click.option("--mount", "mounts", multiple=True, metavar="SRC:DST", help="container mount (repeatable); the workdir must be "
                                                                          "visible on every node")
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="default: <workdir>/slurm/specpipe.sbatch")
@click.option("--submit", is_flag=True, help="submit the script with sbatch")
def slurm(config, workdir, overrides, out, submit, **job):
    """Write an sbatch script that runs the pipeline (in a container with --image) on one node or several.
    `job`: the SlurmJob fields given as options (--image, --nodes, --gpus-per-node, --time, --partition, --account,
    --mount)."""
    from pipeline.commands import slurm as C
    from pipeline.slurm import SlurmJob

    try:
        cfg = _load(config, overrides)
    except SpecpipeError as e:
        _fail(e)
        return
    wd = str(Path(workdir) if workdir else _default_workdir(config))
    if any(c in wd for c in '"\n'):
        _fail(UsageError(f"--workdir {wd!r}: a path with quotes or newlines cannot go into an #SBATCH line"))
    job = SlurmJob(config=str(Path(config).resolve()), workdir=str(Path(wd).resolve()),
                   **{**job, "mounts": list(job["mounts"])}, overrides=list(overrides))
    path = Path(out) if out else Path(wd) / "slurm" / "specpipe.sbatch"
    C.write_script(cfg, job, path)
    click.echo(str(path))
    if submit:
        try:
            r = C.submit(path)
        except UsageError as e:
            _fail(e)
            return
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
