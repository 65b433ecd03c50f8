"""Stage `export`: Triton model repositories for the deployment `build` wrote.

  triton/        the production repository for Triton's TensorRT-LLM LLM-API model
                 (`tensorrt_llm/config.pbtxt` with `max_batch_size` and the decoupled transaction policy, `tensorrt_llm/1/
                 model.yaml` = the LLM-API options + `triton_config`, the FP8 target and the draft TensorRT-LLM loads under
                 `tensorrt_llm/1/`), plus `launch.sh` and a README for `nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3`.
                 The container provides the model code (`/app/all_models/llmapi/tensorrt_llm/1/{model.py,helpers.py}`);
                 launch.sh assembles a serving copy of the repository with it, so the mounted directory stays read-only.
  triton_cpu/    the same model name and request/response interface, served by a Python-backend model that runs
                 the same FP8 pair through specpipe's speculative runtime (runtime/serving/triton_model/model.py), so
                 `specpipe serve` answers on a CPU with the acceptance statistics TensorRT-LLM would report.
  speculators/   the draft in the speculators format for vLLM (runtime/vllm/speculators_format.py), with the tuned
                 draft length, a README and `serve_vllm.sh` (`vllm serve <FP8 target> --speculative-config ...`).
  monitoring/    Prometheus alerting rules and a Grafana dashboard per serving engine (pipeline/monitor_alerts.py).
  export.json    what was exported and checked, and the identity (sha256 of config, tokenizer, weights) of the
                 exported target and drafts that `specpipe monitor` compares with what is served.

Refuses to run when `validate`'s gate failed. Every config.pbtxt is parsed with Triton's model-config protobuf (tritonclient
2.51, the version of the server `specpipe serve` runs); model.yaml is checked against the targeted version's field list.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
from pathlib import Path
from typing import Literal

from pydantic import Field

from pipeline import monitor_alerts
from pipeline.artifacts import build as build_artifact
from pipeline.artifacts import data as data_artifact
from pipeline.artifacts import export as export_artifact
from pipeline.artifacts import tune as tune_artifact
from pipeline.artifacts import validate as validate_artifact
from pipeline.errors import StageError
from pipeline.monitor_diagnosis import served_identity
from pipeline.stage import Artifact, StageContext, StageSection
from runtime.quant import hf_quant_config
from runtime.records_deploy import ExportInfo

NAME = "export"
CONSUMES: tuple[str, ...] = ("data", "train_draft", "quantize", "validate", "build", "tune")   # tune: vLLM's per-batch k
VERSION = "5"   # 5: monitoring/ (Prometheus rules, Grafana dashboards) and served_identity in export.json
PACKAGES = ("tritonclient",)


class Config(StageSection):
    model_name: str = Field("tensorrt_llm", pattern=r"^[A-Za-z0-9_.-]+$",
                            description="Triton model name in both repositories (the LLM-API template's name)")
    decoupled: bool = Field(True, description="decoupled transaction policy: needed for streaming")
    cancellation_check_period_ms: int = Field(100, ge=1, description="model.yaml triton_config: how often cancellations are "
                                                                     "polled")
    container_path: str = Field("/opt/specpipe/triton", pattern=r"^/",
                                description="where launch.sh expects triton/ mounted inside the container")
    weights: Literal["link", "copy"] = Field("link", description="hard-link the checkpoints (copy across filesystems) or copy")
    cpu_repository: bool = Field(True, description="also write triton_cpu/ (served by `specpipe serve`)")
    cpu_compute: Literal["fp32", "bf16", "auto"] = Field("fp32", description=(
        "compute mode of the CPU repository's runtime: fp32 (exact, what validate measured), bf16 (bf16 GEMMs, "
        "fp32 elsewhere: faster where the CPU has native bf16 GEMMs, greedy choices within docs/serving.md's "
        "bounds of fp32), auto (bf16 on such a CPU, else fp32); config parameter specpipe_compute overrides it"))
    speculators: bool = Field(True, description=(
        "also write speculators/: the BF16 draft in the speculators 0.9 format with the tuned draft length and a "
        "`vllm serve` command, for vLLM"))
    speculators_verifier: str | None = Field(None, description=(
        "speculators/config.json verifier.name_or_path: the target as the serving side names it (a hub id, or its "
        "path there); default: target.model when it is a hub id, else the FP8 target's path on this machine"))


def run(ctx: StageContext) -> dict:
    from runtime.files import publish_tree
    from runtime.trtllm import compat
    from runtime.trtllm import schema as trtllm_schema

    sec: Config = ctx.section
    acc = validate_artifact.read_acceptance(ctx.input("validate").path)
    _require_gate(acc)
    bpath = ctx.input("build").path
    dep = build_artifact.read_deployment(bpath)
    options = build_artifact.read_options(bpath, dep)
    version = dep.trtllm_version
    io = trtllm_schema.load_schema("triton-llmapi-model")["config_pbtxt"]
    speculation = bool(options.get("speculative_config"))
    image = compat.triton_image_for(version)
    fmt = _production_repository(ctx, dep, options, io, image, speculation)
    if sec.cpu_repository:
        _cpu_repository(ctx, dep, acc, io, speculation)
    vllm = _speculators(ctx, dep, options) if sec.speculators and speculation else None
    if sec.speculators and not speculation:
        ctx.log.info("speculators/: not written, the deployment runs the target alone (tune found no draft length that pays)")

    profile = _speculation_profile(ctx, acc, dep, vllm) if speculation else None
    monitoring = monitor_alerts.export(ctx.out_dir, ctx.out_dir / profile["files"][0], model=sec.model_name,
                                       draft_len=dep.schedule().k_at(1), log=ctx.log) if profile else None
    drafts = {"draft": dep.trtllm_draft_dir, "draft_cpu": dep.draft_dir if sec.cpu_repository else None,
              "draft_speculators": ctx.out_dir / "speculators" if vllm else None} if speculation else {}
    bf16 = Path(ctx.workdir) / "artifacts" / "target" / "model"     # what `specpipe serve --engine vllm` serves on a CPU
    served = served_identity(dep.target_dir, {"target_bf16": bf16 if (bf16 / "config.json").is_file() else None, **drafts})
    parsed = check_pbtxt([p for p in ctx.out_dir.rglob("config.pbtxt")])
    ctx.log.info("config.pbtxt: %s", ", ".join(f"{Path(k).relative_to(ctx.out_dir)} {v}" for k, v in parsed.items()))
    info = ExportInfo(model_name=sec.model_name, trtllm_version=version, triton_image=image, serving_image=dep.serving_image,
                      decoupled=sec.decoupled, container_path=sec.container_path, speculation=speculation,
                      prompt_format={**fmt, "file": "triton/prompt_format.json"},
                      cpu_repository="triton_cpu" if sec.cpu_repository else None,
                      config_pbtxt={str(Path(k).relative_to(ctx.out_dir)): v for k, v in parsed.items()}, speculators=vllm,
                      speculation_profile=profile, monitoring=monitoring, served_identity=served)
    (ctx.out_dir / export_artifact.INFO).write_text(json.dumps(info.to_json(), indent=2))
    publish_tree(ctx.out_dir)      # world-readable: a non-root container user reads the repositories
    if image is None:
        ctx.log.warning("no Triton image ships TensorRT-LLM %s: serve the production repository from a custom image "
                        "built on %s (see triton/README.md)", version, dep.serving_image)
    return {"model_name": sec.model_name, "trtllm_version": version, "triton_image": image or "custom",
            "cpu_repository": sec.cpu_repository, "config_pbtxt_checked": sum(v == "parsed" for v in parsed.values()),
            "speculators": vllm["speculators_model_type"] if vllm else None}


def _speculation_profile(ctx: StageContext, acc: validate_artifact.AcceptanceInfo, dep: build_artifact.DeploymentInfo,
                         vllm: dict | None) -> dict:
    """speculation_profile.json (runtime/validate/profile.py, docs/stages/build_export.md) beside every draft this
    stage ships: the TensorRT-LLM draft of triton/, the CPU repository's draft, speculators/."""
    from runtime.validate import profile as P

    sec: Config = ctx.section
    doc = validate_artifact.speculation_profile(ctx.input("validate"), ctx.input("quantize"), ctx.input("train_draft"),
                                                algorithm=dep.algorithm, draft_schedule=dep.schedule_json(),
                                                deployed_draft_len=dep.schedule().k_at(1))
    dirs = [ctx.out_dir / "triton" / sec.model_name / "1" / "draft"]
    if sec.cpu_repository:
        dirs.append(ctx.out_dir / "triton_cpu" / sec.model_name / "1" / "draft")
    if vllm:
        dirs.append(ctx.out_dir / "speculators")
    files = [str(f.relative_to(ctx.out_dir)) for f in P.write_profile(doc, dirs)]
    ctx.log.info("speculation_profile.json (%s, AL %s at the deployed k=%s, %s at the measured k=%s): %s",
                 doc["measurement_conditions"]["engine"], doc["deployed_accept_length"], doc["deployed_draft_len"],
                 doc["mean_accept_length"], doc["num_speculative_tokens"], ", ".join(files))
    return {"files": files, "engines": [m["engine"] for m in doc["measurements"]],
            "mean_accept_length": doc["mean_accept_length"], "num_speculative_tokens": doc["num_speculative_tokens"],
            "deployed_draft_len": doc["deployed_draft_len"], "deployed_accept_length": doc["deployed_accept_length"]}


def _production_repository(ctx: StageContext, dep: build_artifact.DeploymentInfo, options: dict, io: dict, image: str | None,
                           speculation: bool) -> dict:
    """triton/: Triton's TensorRT-LLM LLM-API model (model.yaml, config.pbtxt, the checkpoints), launch.sh, README."""
    from runtime.serving import prompt_format as P
    from runtime.trtllm import options as T
    from runtime.trtllm import triton_launch

    sec: Config = ctx.section
    version = dep.trtllm_version
    prod = ctx.out_dir / "triton"
    mdir = prod / sec.model_name / "1"
    mdir.mkdir(parents=True)
    _place(Path(dep.target_dir), mdir / "target_fp8", sec.weights)
    if speculation:   # the draft as TensorRT-LLM loads it (layer names of the targeted version, see build)
        _place(Path(dep.trtllm_draft_dir), mdir / "draft", sec.weights)
    body = _model_yaml(sec, options, version)
    (mdir / "model.yaml").write_text(
        f"# TensorRT-LLM {version} LLM-API options for Triton's llmapi model (every key but triton_config goes to LLM(...)).\n"
        f"# Paths are inside the container: triton/ mounted at {sec.container_path}.\n"
        "# triton_config.max_batch_size 0: the LLM-API model batches in TensorRT-LLM, not in Triton. config.pbtxt states\n"
        "# the same max_batch_size and decoupled policy: launch_triton_server.py disables auto-complete-config.\n"
        + T.dump_yaml(body))
    (prod / sec.model_name / "config.pbtxt").write_text(
        config_pbtxt(sec.model_name, io, decoupled=sec.decoupled,
                     max_batch_size=body["triton_config"]["max_batch_size"]))
    (prod / "launch.sh").write_text(triton_launch.launch_sh(sec.container_path, sec.model_name,
                                                            int(options.get("tensor_parallel_size") or 1)))
    (prod / "launch.sh").chmod(0o755)
    fmt = _prompt_format(ctx, dep, prod)
    (prod / "README.md").write_text(_readme(sec, dep, image, ctx.workdir)
                                     + P.readme_section(fmt, sec.container_path, sec.model_name))
    return fmt


def _prompt_format(ctx: StageContext, dep: build_artifact.DeploymentInfo, prod: Path) -> dict:
    """triton/prompt_format.json (+ chat_template.jinja): how clients must render prompts, since the LLM-API model
    generates from `text_input` as it is (runtime/serving/prompt_format.py). The template is the one `data` rendered
    validate's prompts with (data/chat_template.jinja), else none."""
    from transformers import AutoTokenizer

    from runtime.serving import prompt_format as P

    src = ctx.input("data").path / data_artifact.CHAT_TEMPLATE
    template = tok = None           # no template: raw-text prompts, clients send text as it is
    if src.is_file():
        template = src.read_text()
        (prod / "chat_template.jinja").write_text(template)
        try:
            tok = AutoTokenizer.from_pretrained(str(dep.target_dir), trust_remote_code=False)
        except (OSError, ValueError) as e:
            raise StageError(f"the target's tokenizer ({dep.target_dir}) does not load, so the prompt format clients "
                             f"must use cannot be written: {e}") from None
    fmt = P.describe(tok, template, template_file="chat_template.jinja")
    evals = data_artifact.read_eval(ctx.input("data").path)
    fmt["domains"] = P.domain_formats(tok, template, {d: [p.prompt for p in ps] for d, ps in evals.items()})
    (prod / "prompt_format.json").write_text(json.dumps(fmt, indent=2))
    return fmt


def _model_yaml(sec: Config, options: dict, version: str) -> dict:
    """The body of `tensorrt_llm/1/model.yaml`: the LLM-API options with the paths inside the container, plus
    `triton_config`. Every key must exist in `version`'s schema."""
    from runtime.trtllm import schema as trtllm_schema

    in_container = f"{sec.container_path.rstrip('/')}/{sec.model_name}/1"
    body = {"model": f"{in_container}/target_fp8", "backend": "pytorch", **options}
    if options.get("speculative_config"):
        body["speculative_config"] = {**options["speculative_config"], "speculative_model": f"{in_container}/draft"}
    # Per-request speculative statistics: the LLM-API model returns acceptance_rate / total_accepted_draft_tokens /
    # total_draft_tokens for requests with sampling_param_return_perf_metrics; the LLM-level flag (BaseLlmArgs,
    # 1.2 line) also records the request timestamps those responses carry. `specpipe monitor` reads them.
    body.setdefault("return_perf_metrics", True)
    body["triton_config"] = {"max_batch_size": 0, "decoupled": sec.decoupled,
                             "cancellation_check_period_ms": sec.cancellation_check_period_ms}
    if bad := trtllm_schema.unknown_keys(body, version, model_yaml=True):
        raise StageError(f"model.yaml would carry keys TensorRT-LLM {version} does not know: {bad}")
    return body


def _cpu_repository(ctx: StageContext, dep: build_artifact.DeploymentInfo, acc: validate_artifact.AcceptanceInfo, io: dict,
                    speculation: bool) -> None:
    """triton_cpu/: the same model name and interface, a Python-backend model running specpipe's runtime."""
    from importlib import resources

    import runtime

    sec: Config = ctx.section
    cpu = ctx.out_dir / "triton_cpu"
    cdir = cpu / sec.model_name / "1"
    cdir.mkdir(parents=True)
    _place(Path(dep.target_dir), cdir / "target_fp8", sec.weights)
    if speculation:   # specpipe's runtime reads the draft as train_draft/quantize wrote it
        _place(Path(dep.draft_dir), cdir / "draft", sec.weights)
    (cdir / "model.py").write_text(resources.files("runtime.serving").joinpath("triton_model", "model.py").read_text())
    (cdir / "specpipe_model.json").write_text(json.dumps({
        "target": "target_fp8", "draft": "draft" if speculation else None, "algorithm": dep.algorithm,
        "draft_len": dep.schedule().k_at(1),         # the CPU model batches continuously with one k: batch 1's
        "draft_schedule": dep.schedule_json(),   # per batch size, as the TensorRT-LLM deployment runs it
        "eos_token_ids": acc.eos_token_ids or None,     # the stop ids validate decoded with (target.json)
        "compute": sec.cpu_compute,                    # runtime.engine.compute.resolve_compute on the serving machine
        "trtllm_version": dep.trtllm_version, "specpipe_src": str(Path(runtime.__file__).resolve().parents[1])},
        indent=2))
    (cpu / sec.model_name / "config.pbtxt").write_text(
        config_pbtxt(sec.model_name, io, decoupled=sec.decoupled))


def _speculators(ctx: StageContext, dep: build_artifact.DeploymentInfo, options: dict) -> dict:
    """speculators/: the trained (BF16) draft in the speculators format, its README and `serve_vllm.sh`."""
    from runtime.vllm import serve as V
    from runtime.vllm import speculators_format as S

    src = ctx.input("train_draft").path / "draft"
    final = Path(ctx.workdir).resolve() / "artifacts" / NAME / "speculators"     # where it lives once committed
    try:
        spec = S.write_speculators_draft(src, ctx.out_dir / "speculators", target_dir=dep.target_dir,
                                         speculative_tokens=int(dep.max_draft_len or 0),
                                         verifier_name_or_path=_verifier_name(ctx, dep))
    except S.SpeculatorsFormatError as e:
        raise StageError(f"the draft cannot be written in the speculators format for vLLM: {e} "
                         "(export.speculators: false exports without it)") from None
    kv = hf_quant_config.kv_cache_quant_algo(dep.target_dir)
    sched = V.schedule_from_predicted(tune_artifact.read_tuning(ctx.input("tune").path).predicted)
    argv = V.vllm_serve_command(spec, target=dep.target_dir, draft=str(final), max_model_len=dep.max_seq_len,
                                kv_cache_fp8=kv == "FP8",
                                tensor_parallel_size=int(options.get("tensor_parallel_size") or 1), schedule=sched)
    (spec.path / "README.md").write_text(V.readme(spec, argv, draft=str(final), source_draft=str(src.resolve()),
                                                  deployed_draft=dep.draft_dir))
    (spec.path / "serve_vllm.sh").write_text(V.serve_script(argv))
    (spec.path / "serve_vllm.sh").chmod(0o755)
    ctx.log.info("speculators/: %s draft for vLLM, %d speculative tokens, capture layers %s (speculators numbering), %s",
                 spec.algorithm, spec.speculative_tokens, spec.aux_hidden_state_layer_ids,
                 f"draft vocabulary {spec.draft_vocab_size} with d2t/t2d" if spec.has_d2t else "full vocabulary")
    for note in spec.notes:
        ctx.log.info("speculators/: %s", note)
    return {**spec.as_dict(), "source_draft": str(src.resolve()), "vllm_serve": shlex.join(argv),
            "readme": "speculators/README.md", "script": "speculators/serve_vllm.sh"}


def _verifier_name(ctx: StageContext, dep: build_artifact.DeploymentInfo) -> str:
    """What speculators/config.json names as the verifier: `export.speculators_verifier`, else the target's hub id
    (target.model, when it is not a local path), else the FP8 target's path here (logged: only valid on this machine)."""
    model = ctx.config.target.model
    if ctx.section.speculators_verifier:
        return ctx.section.speculators_verifier
    if model and not model.startswith((".", "/", "~")) and model.count("/") == 1 and not Path(model).exists():
        return model
    ctx.log.warning("speculators/config.json names the verifier by its path on this machine (%s): set "
                    "export.speculators_verifier to the target as the serving side names it", dep.target_dir)
    return str(Path(dep.target_dir).resolve())


def fingerprint_extra(section: Config) -> dict | None:
    """The CPU repository carries a copy of runtime/serving/triton_model/model.py, which runs specpipe's runtime: that
    file and the runtime code it imports enter the fingerprint, so a changed serving model or engine is re-exported."""
    if not section.cpu_repository:
        return None
    from importlib import resources

    from pipeline import codehash

    model = Path(str(resources.files("runtime.serving").joinpath("triton_model", "model.py"))).resolve()
    return {**codehash.code_digests(model), "model.py as copied (bytes)": codehash.byte_digest(model)}


def _require_gate(acc: validate_artifact.AcceptanceInfo) -> None:
    if acc.passed:
        return
    failed = "; ".join(r.failure() for r in acc.gates.rows if not r.passed) or json.dumps(acc.gates.detail, default=str)
    raise StageError("validate's acceptance gate did not pass, so there is nothing to export: "
                     f"{failed[:800]}. Retrain or retune the draft, or relax the gate in "
                     "the validate section if the measured acceptance is acceptable.")


def _place(src: Path, dst: Path, mode: str) -> None:
    """Hard-link (or copy) a checkpoint directory: the repositories must be self-contained to be mounted. The tokenizer
    config is then written in its portable form (a new file; the source is not modified)."""
    from runtime.text.tokenizer_files import portable_tokenizer

    if not (src / "config.json").exists():
        raise StageError(f"{src} is not a checkpoint directory (no config.json)")
    for f in sorted(p for p in src.rglob("*") if p.is_file()):
        out = dst / f.relative_to(src)
        out.parent.mkdir(parents=True, exist_ok=True)
        if mode == "link":
            try:
                os.link(f, out)
                continue
            except OSError:
                pass
        shutil.copy2(f, out)
    portable_tokenizer(dst)


# ---------------------------------------------------------------------------------------------- config.pbtxt


def config_pbtxt(name: str, io: dict, *, decoupled: bool = True, max_batch_size: int = 0) -> str:
    """The LLM-API model's config (inputs/outputs from the extracted schema), stating `max_batch_size` and the
    transaction policy itself: the container's launcher (`launch_triton_server.py`) always passes
    --disable-auto-complete-config, so the model's `auto_complete_config`, which would copy them from model.yaml's
    triton_config, never runs (compat.SOURCES['decoupled']); without `decoupled: true` here streaming requests are
    refused. The CPU repository's config is the same interface."""
    lines = [f'name: "{name}"', 'backend: "python"', f"max_batch_size: {int(max_batch_size)}",
             f"model_transaction_policy {{ decoupled: {'true' if decoupled else 'false'} }}"]
    for kind, items in (("input", io["inputs"]), ("output", io["outputs"])):
        for it in items:
            opt = " optional: true" if it.get("optional") else ""
            dims = ", ".join(str(d) for d in it["dims"])
            lines.append(f'{kind} {{ name: "{it["name"]}" data_type: {it["data_type"]} dims: [ {dims} ]{opt} }}')
    lines.append("instance_group [ { count: 1 kind: KIND_CPU } ]")
    return "\n".join(lines) + "\n"


def check_pbtxt(paths: list[Path]) -> dict[str, str]:
    """Parse each config.pbtxt with Triton's model-config protobuf; a parse error fails the stage."""
    try:
        from google.protobuf import text_format
        from tritonclient.grpc import model_config_pb2
    except ImportError:
        return {str(p): "not checked (tritonclient not installed)" for p in paths}
    out = {}
    for p in paths:
        try:
            text_format.Parse(p.read_text(), model_config_pb2.ModelConfig())
        except text_format.ParseError as e:
            raise StageError(f"{p} does not parse as a Triton model config: {e}") from None
        out[str(p)] = "parsed"
    return out


# ---------------------------------------------------------------------------------------------- launch + README


def _readme(sec: Config, dep: build_artifact.DeploymentInfo, image: str | None, workdir: Path) -> str:
    here = shlex.quote(str(Path(workdir).resolve() / "artifacts" / "export" / "triton"))
    img = image or f"<a custom Triton image built on {dep.serving_image}>"
    spec = dep.speculation
    draft = (f" and the {dep.decoding_type} draft (`1/draft/`, its layers named as TensorRT-LLM "
             f"{dep.trtllm_version} reads them)") if spec else " (no draft)"
    ask = json.dumps({"text_input": "def add(a, b):", "sampling_param_max_tokens": 64,
                      "sampling_param_return_perf_metrics": True})
    no_draft = '' if spec else (chr(10) + "No draft: `tune` predicted no speedup from speculation at any batch size, so "
                                "the target is served alone (see ../../build/deployment/README.md)." + chr(10))
    vllm = ("For vLLM, `../speculators/` holds the same draft in the speculators format with its `vllm serve` command."
            + chr(10)) if sec.speculators and spec else ""
    return f"""# Triton repository for TensorRT-LLM {dep.trtllm_version} (LLM-API model)

`{sec.model_name}/config.pbtxt` is the LLM-API model's interface; `{sec.model_name}/1/model.yaml` holds the
LLM-API options specpipe built (every key but `triton_config` goes to `LLM(...)`), with the FP8 target
(`1/target_fp8/`){draft}
next to it, referenced by their paths inside the container ({sec.container_path}).

The model code (`model.py`, `helpers.py`) is not copied here: it comes with the container, under
`/app/all_models/llmapi/tensorrt_llm/1/`, and must match its TensorRT-LLM. `launch.sh` copies it into a
serving copy of this repository (`/tmp/specpipe_model_repo`) and then becomes the server (`exec tritonserver` with
the flags of the container's `/app/scripts/launch_triton_server.py`, which itself would start the server in the
background and return, ending the container). Ports: `-e HTTP_PORT=... -e GRPC_PORT=... -e METRICS_PORT=...`.

## Serve
```bash
docker run --gpus all --rm -it --ipc=host --shm-size=2g -p 8000:8000 -p 8001:8001 -p 8002:8002 \\
  -v {here}:{sec.container_path}:ro \\
  {img} bash {sec.container_path}/launch.sh
```
Container for this version (runtime/trtllm/compat.py): `{img}`.

## Ask
```bash
curl -s localhost:8000/v2/models/{sec.model_name}/generate -d '{ask}'
curl -s -N localhost:8000/v2/models/{sec.model_name}/generate_stream -d '{{"text_input": "def add(a, b):", "streaming": true}}'
```
With `sampling_param_return_perf_metrics: true` the response carries `acceptance_rate`,
`total_accepted_draft_tokens` and `total_draft_tokens`. `config.pbtxt` states `max_batch_size: 0` and
`model_transaction_policy {{ decoupled: {str(sec.decoupled).lower()} }}` itself (the same values as model.yaml's
`triton_config`): launch.sh starts Triton with `--disable-auto-complete-config` (as `launch_triton_server.py` does), so the
model's `auto_complete_config` does not copy them from model.yaml.
{no_draft}

The sibling repository `../triton_cpu/` serves the same FP8 pair with the same interface on a CPU
(`specpipe serve --workdir <run>`), through specpipe's speculative runtime instead of TensorRT-LLM.
{vllm}"""


def report(artifact: Artifact) -> str:
    from pipeline.report import esc, table

    doc = artifact.read_json("export.json")
    return (f"<p>model <code>{esc(doc['model_name'])}</code> for TensorRT-LLM {esc(doc['trtllm_version'])} in "
            f"<code>{esc(str(doc['triton_image']))}</code>; CPU repository: {esc(str(doc['cpu_repository']))}</p>"
            + table([{"config.pbtxt": k, "check": v} for k, v in doc["config_pbtxt"].items()])
            + _speculators_report(doc.get("speculators")))


def _speculators_report(s: dict | None) -> str:
    from pipeline.report import esc, table

    if not s:
        return "<p>vLLM (speculators format): not written</p>"
    return (f"<p>vLLM: <code>{esc(s['dir'])}/</code>, the {esc(s['speculators_model_type'])} draft in the "
            f"{esc(s['format'])} format; <code>{esc(s['script'])}</code> runs <code>{esc(s['vllm_serve'])}</code></p>"
            + table([{"speculative tokens": s["speculative_tokens"],
                      "capture layers (speculators / ModelOpt)": f"{s['aux_hidden_state_layer_ids']} / {s['modelopt_layer_ids']}",
                      "draft vocabulary": f"{s['draft_vocab_size']} of "
                                          f"{s['vocab_size']}" + (" (d2t, t2d)" if s["has_d2t"] else ""),
                      "verifier": s["verifier"]}])
            + "".join(f"<p>{esc(n)}</p>" for n in s.get("notes", [])))
