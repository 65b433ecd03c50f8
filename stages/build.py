"""Stage `build`: the TensorRT-LLM deployment of the FP8 target and its draft.

For EAGLE-3 and DFlash TensorRT-LLM has no engine build: they run in the PyTorch backend (LLM API), where the deployment
is the checkpoint pair plus the LLM-API options (CUDA graphs are captured when `LLM(...)` starts). So this stage writes,
for the TensorRT-LLM version it targets (`build.trtllm_version`, default the version the shipped Triton image pins,
`runtime/trtllm/compat.py`) and in that version's forms:

  deployment/llm_api_options.yaml   speculative_config (the tuned draft length per batch size, the capture layers, the
                                    acceptance guard, sa_config where tune chose the suffix-automaton enhancer and the
                                    version has it, else refused with the reason), batch/token/sequence limits, chunked
                                    prefill, KV, CUDA graphs
  deployment/draft/                 the EAGLE-3 draft with its layers renamed for the targeted loader (1.2: midlayer.*)
  deployment/[draft/]speculation_profile.json  the draft's measured acceptance (validate's, ModelOpt's proposed schema,
                                    docs/stages/build_export.md): in draft/ where build writes the draft, else beside the options
  deployment/serve.sh               trtllm-serve <FP8 target> --backend pytorch --extra_llm_api_options ...
  deployment/bench.sh               trtllm-bench throughput on bench_dataset.jsonl (the eval prompts, repeated to hold
                                    `bench.rounds` x the bench concurrency requests)
  deployment/README.md              what was built, for which version/container, draft length by batch, checks, usage
  deployment.json                   the same facts for `export` and `status`
  deployment/ngram/                 with build.ngram.enabled: n-gram drafting of the target (runtime/trtllm/ngram_deployment.py)

When `tune` found that speculation never pays, the deployment is the target alone and the README says why. Every key is
checked against the version's field list; the named checks of `runtime.trtllm.checks.consistency_checks` must pass. Where
`tensorrt_llm` imports and a CUDA GPU exists, `LLM(...)` is instantiated from the written options and a short generation
is run; elsewhere the stage records plainly that the deployment was written, not loaded.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field, field_validator

from pipeline.artifacts import build as build_artifact
from pipeline.artifacts import data as data_artifact
from pipeline.artifacts import quantize as quantize_artifact
from pipeline.artifacts import train_draft as train_draft_artifact
from pipeline.artifacts import tune as tune_artifact
from pipeline.errors import StageError
from pipeline.stage import Artifact, StageContext, StageSection, Strict
from runtime.algorithms.registry import get as get_algorithm
from runtime.algorithms.schedule import DraftSchedule
from runtime.records_deploy import CheckRow, DeploymentInfo
from runtime.trtllm import compat, config_checks

if TYPE_CHECKING:
    from runtime.trtllm.checks import Check
    from runtime.trtllm.options import DeploymentSpec

NAME = "build"
CONSUMES: tuple[str, ...] = ("target", "data", "train_draft", "quantize", "validate", "tune")
VERSION = "4"   # 3: build.ngram (deployment/ngram/); 4: build.chunked_prefill (long prompts)
PACKAGES = ("tensorrt_llm",)
USES = ("hardware",)


class KvCache(Strict):
    free_gpu_memory_fraction: float = Field(0.85, gt=0, le=1, description="GPU memory left after weights given to the KV cache")
    enable_block_reuse: bool = Field(True, description="reuse KV blocks across requests with a shared prefix")
    dtype: Literal["auto", "fp8"] = Field("auto", description="auto: follow the target's hf_quant_config.json")


class AcceptanceGuard(Strict):
    """Switch speculation off for good when the rolling acceptance rate drops below a floor (written in the
    targeted version's terms: 1.2 thresholds an acceptance length, 1.3 a rate)."""

    window: int = Field(ge=1, description="1.2: completed requests; 1.3: speculation-enabled iterations")
    min_acceptance_rate: float = Field(ge=0, le=1, description=(
        "accepted / drafted; 1.2 gets rate x max_draft_len (it thresholds accepted draft tokens per step, AL - 1)"))


class Bench(Strict):
    output_tokens: int = Field(128, ge=1, description="output tokens per bench request")
    concurrency: int | None = Field(None, ge=1, description="default: max_batch_size")
    rounds: int = Field(4, ge=1, description=(
        "the dataset holds at least rounds x concurrency requests (eval prompts repeated), so the largest "
        "concurrency measured is kept full"))
    model_name: str | None = Field(None, description="trtllm-bench --model (a name, not a path); default from the target")


class NgramDeploy(Strict):
    """n-gram (prompt-lookup) drafting deployed beside the trained pair: deployment/ngram/ (runtime/trtllm/ngram_deployment.py)"""

    enabled: bool = Field(False, description="write TensorRT-LLM's and vLLM's n-gram configs for the target")
    k: int | None = Field(None, ge=1, le=16, description="draft tokens per step; default: what validate measured")
    min_n: int | None = Field(None, ge=1, description="vLLM prompt_lookup_min (TensorRT-LLM has none); default: validate's")
    max_n: int | None = Field(None, ge=1, description="vLLM prompt_lookup_max, TensorRT-LLM max_matching_ngram_size")


class Config(StageSection):
    backend: Literal["pytorch", "tensorrt"] = Field("pytorch", description=(
        "TensorRT-LLM backend; EAGLE-3 and DFlash run only in pytorch (the LLM API), tensorrt is refused"))
    trtllm_version: str = Field(compat.DEFAULT_TRTLLM_VERSION, description=(
        "TensorRT-LLM whose field names and semantics are written; default: the version the shipped Triton image pins"))
    eagle3_mode: Literal["one_model", "two_model"] = Field("one_model", description="two_model (1.2 only) also writes "
                                                                                    "disable_overlap_scheduler: true")
    max_batch_size: int | None = Field(None, ge=1, description="default: from tune")
    max_num_tokens: int | None = Field(None, ge=1, description="default: from tune")
    max_seq_len: int | None = Field(None, ge=16, description="default: min(target, draft) positions (see chunked_prefill)")
    chunked_prefill: Literal["auto", "on", "off"] = Field("auto", description=(
        "auto: enable_chunked_prefill where a prompt of max_seq_len - 1 tokens exceeds max_num_tokens (refused without "
        "it); off: never, and the default max_seq_len is capped at max_num_tokens (a deliberate prompt limit)"))
    kv_cache: KvCache = Field(default_factory=KvCache)
    cuda_graphs: bool = Field(True, description="CUDA-graph batch sizes from tune (schedule boundaries included)")
    pipeline_parallel_size: int = Field(1, ge=1, description="> 1 is refused: speculation needs pipeline_parallel_size 1")
    acceptance_guard: AcceptanceGuard | None = Field(None, description="switch speculation off when acceptance collapses")
    bench: Bench = Field(default_factory=Bench, description="trtllm-bench command and dataset")
    load: Literal["auto", "never"] = Field("auto", description="auto: instantiate LLM(...) where TensorRT-LLM and a GPU exist")
    ngram: NgramDeploy = Field(default_factory=NgramDeploy)

    @field_validator("trtllm_version", mode="before")
    @classmethod
    def _known_version(cls, v):
        return compat.normalize_version(v)  # ValueError names the supported lines


def check(cfg) -> list[tuple[str, str]]:
    sec: Config = cfg.build
    algo = cfg.train_draft.algorithm.kind
    out: list[tuple[str, str]] = []
    if sec.backend == "tensorrt":
        out.append(("build.backend", (
            f"the TensorRT-engine path (trtllm-build --speculative_decoding_mode draft_tokens_external|lookahead_decoding|"
            f"medusa|explicit_draft_tokens|eagle) serves EAGLE-1/2, Medusa, ReDrafter, Lookahead and draft/target only; "
            f"{cfg.train_draft.algorithm.traits.title} runs only in the PyTorch backend (LLM API), and the engine "
            "backend gets no new features: set build.backend: pytorch")))
    if (p := compat.algorithm_problem(sec.trtllm_version, algo)) is not None:
        out.append(("build.trtllm_version", p))
    rel = compat.release(sec.trtllm_version)
    if cfg.train_draft.algorithm.traits.trtllm_two_model and sec.eagle3_mode == "two_model" and not rel.eagle3_two_model:
        out.append(("build.eagle3_mode", f"TensorRT-LLM {sec.trtllm_version} always runs EAGLE-3 as one model "
                                         "(eagle3_one_model: false is reset to true); use one_model or a 1.2 version"))
    out += config_checks.fp8_draft_fc_problems(cfg, rel, algo) + config_checks.draft_kv_problems(cfg, rel, algo)
    if sec.pipeline_parallel_size > 1:
        out.append(("build.pipeline_parallel_size", "speculative decoding is incompatible with pipeline parallelism "
                                                    "in TensorRT-LLM; use hardware.tensor_parallel_size instead"))
    return out


# ---------------------------------------------------------------------------------------------- run


@dataclass
class _Plan:
    """What the deployment is, resolved from the upstream artifacts and the section before anything is written."""

    version: str
    rel: compat.Release
    arts: Path                  # <workdir>/artifacts: quantize.json paths are relative to it
    target_dir: Path            # the FP8 target
    draft_src: Path             # the draft as train_draft/quantize wrote it
    tcfg: dict                  # the target's config.json
    draft: train_draft_artifact.DraftInfo
    dcfg: dict                  # the draft's config.json ({} without speculation)
    tuning: tune_artifact.TuningInfo
    algo: str
    mode: str
    schedule: DraftSchedule     # tune's draft length per batch size
    mbs: int
    kmax: int
    speculation: bool

    @property
    def capture_layers(self) -> list[int] | None:
        return self.draft.capture_layers if get_algorithm(self.algo).trtllm_layers_to_capture else None


@dataclass
class _DeployedDraft:
    """The draft TensorRT-LLM loads: `dir` as the checks read it now, `final` where the options name it."""

    dir: Path | None
    final: Path | None
    renamed: int


@dataclass
class _Bench:
    concurrency: int
    prompts: int
    requests: int
    model_name: str


def run(ctx: StageContext) -> dict:
    from runtime.files import publish_tree
    from runtime.trtllm import load, readme
    from runtime.trtllm import options as T

    sec: Config = ctx.section
    plan = _plan(ctx)
    version, mbs = plan.version, plan.mbs
    out = ctx.out_dir / "deployment"
    out.mkdir(parents=True)
    ddraft = _deployment_draft(ctx, plan, out)
    spec = _deployment_spec(ctx, plan, ddraft)
    options = _llm_api_options(spec, version)
    guard_doc, guard_note = T.acceptance_guard(plan.rel, plan.mode, spec.acceptance_window, spec.min_acceptance_rate, plan.kmax)
    if guard_note and plan.speculation:
        ctx.log.warning("%s", guard_note)
    checks = _checked(ctx, plan, options, ddraft)
    bench = _write_options_and_commands(ctx, plan, options, out)
    loaded = (load.try_load(plan.target_dir, options) if sec.load == "auto"
              else {"loaded": False, "reason": "build.load: never"})
    ctx.log.info("load: %s", "loaded" if loaded["loaded"] else loaded["reason"])
    runs = _runs(plan, options)
    info = replace(_deployment_doc(ctx, plan, options, ddraft, (guard_doc, guard_note), bench, checks, loaded),
                   ngram=_ngram(ctx, plan, options, out) if sec.ngram.enabled else None,
                   sa_enhancer={"sa_config": spec.sa_config, "note": spec.sa_note})
    doc = info.to_json()
    (ctx.out_dir / build_artifact.INFO).write_text(json.dumps(doc, indent=2))
    (out / "README.md").write_text(readme.readme(doc, options))
    if plan.speculation:
        _write_profile(ctx, plan, out / "draft" if ddraft.renamed else out, doc, runs.k_at(1))
    publish_tree(ctx.out_dir)      # a container user other than the builder reads the deployment
    ctx.log.info("deployment for TensorRT-LLM %s (%s): %s, %s, batch<=%d, bench %d requests (%d prompts) at "
                 "concurrency %d", version, doc["serving_image"], doc["decoding_type"] or "no speculation",
                 runs.describe(mbs), mbs, bench.requests, bench.prompts, bench.concurrency)
    return {"trtllm_version": version, "mode": plan.mode, "speculation": plan.speculation,
            "decoding_type": doc["decoding_type"], "max_draft_len": plan.kmax, "draft_schedule": runs.describe(mbs),
            "max_batch_size": mbs, "max_num_tokens": options["max_num_tokens"], "checks_passed": len(checks),
            "loaded": loaded["loaded"], "load_note": loaded.get("reason", "loaded"), "bench_requests": bench.requests}


def _ngram(ctx: StageContext, plan: _Plan, options: dict, out: Path) -> dict:
    from pipeline.artifacts import validate as validate_artifact
    from runtime.trtllm import ngram_deployment as N

    acc = validate_artifact.read_acceptance(ctx.input("validate").path)
    try:
        return N.deploy(out / "ngram", options, plan.version, plan.target_dir, ctx.section.ngram.model_dump(), acc,
                        acc.measured_draft_len or plan.kmax or 4, ctx.log)
    except ValueError as e:
        raise StageError(f"build.ngram: {e}") from None


def _write_profile(ctx: StageContext, plan: _Plan, where: Path, doc: dict, k1: int) -> None:
    """speculation_profile.json beside the draft this deployment ships (runtime/validate/profile.py)."""
    from pipeline.artifacts import validate as validate_artifact
    from runtime.validate import profile as P

    prof = validate_artifact.speculation_profile(ctx.input("validate"), ctx.input("quantize"), ctx.input("train_draft"),
                                                 algorithm=plan.algo, draft_schedule=doc.get("draft_schedule"),
                                                 deployed_draft_len=k1)
    f = P.write_profile(prof, [where])[0]
    ctx.log.info("%s: AL %s at the deployed k=%s (%s at the measured k=%s)", f.relative_to(ctx.out_dir),
                 prof["deployed_accept_length"], k1, prof["mean_accept_length"], prof["num_speculative_tokens"])


def _plan(ctx: StageContext) -> _Plan:
    """Read quantize's, train_draft's and tune's artifacts; resolve algorithm, mode, schedule and batch size."""
    from runtime.trtllm import draft_schedule

    sec: Config = ctx.section
    version = sec.trtllm_version
    rel = compat.release(version)
    arts = ctx.input("quantize").path.parent
    quant = quantize_artifact.read_info(ctx.input("quantize").path)
    target_dir = quant.target_dir(arts)
    draft_src = quant.draft_dir(arts)
    draft = train_draft_artifact.read_info(ctx.input("train_draft").path)
    tuning = tune_artifact.read_tuning(ctx.input("tune").path)
    tcfg = json.loads((target_dir / "config.json").read_text())
    algo = draft.algorithm
    if (p := compat.algorithm_problem(version, algo)) is not None:
        raise StageError(p)
    mode = rel.mode(algo, sec.eagle3_mode == "one_model")
    try:
        schedule = draft_schedule.tuned_schedule(tuning, version, mode)
    except ValueError as e:
        raise StageError(str(e)) from None
    mbs = sec.max_batch_size or tuning.max_batch_size
    speculation = schedule.speculates(mbs)
    if not speculation:
        ctx.log.warning("tune predicted no speedup from speculation at any batch size (%s): deploying the target "
                        "alone, without a draft", tuning.note)
    dcfg = train_draft_artifact.read_config(draft_src).raw if speculation else {}
    return _Plan(version=version, rel=rel, arts=arts, target_dir=target_dir, draft_src=draft_src, tcfg=tcfg, draft=draft,
                 dcfg=dcfg, tuning=tuning, algo=algo, mode=mode, schedule=schedule, mbs=mbs,
                 kmax=schedule.max_draft_len(mbs), speculation=speculation)


def _deployment_draft(ctx: StageContext, plan: _Plan, out: Path) -> _DeployedDraft:
    """The EAGLE-3 draft with its layers named as the targeted loader reads them (a renamed copy in
    deployment/draft/ where that differs from ModelOpt's names); None without speculation."""
    from runtime.trtllm.draft_weights import trtllm_draft_dir

    trtllm_draft, renamed = (plan.draft_src if plan.speculation else None), 0
    if plan.speculation and get_algorithm(plan.algo).trtllm_renamed_weights:
        try:
            trtllm_draft, renamed = trtllm_draft_dir(plan.draft_src, out / "draft", plan.rel,
                                                int(plan.dcfg.get("num_hidden_layers") or plan.draft.num_layers or 1))
        except ValueError as e:
            raise StageError(f"the draft's tensor names cannot be written as TensorRT-LLM {plan.version} reads them: "
                             f"{e}") from None
    # the options name the draft where the committed artifact will be (artifacts/build/...), the checks read it here
    final = (plan.arts / NAME / "deployment" / "draft").resolve() if renamed else trtllm_draft
    if renamed:
        ctx.log.info("draft: %d tensors renamed layers.<i>.* -> midlayer.* in deployment/draft/ (TensorRT-LLM %s's "
                     "EAGLE-3 loader does not remap ModelOpt's names; train_draft's artifact is unchanged)", renamed,
                     plan.version)
    return _DeployedDraft(trtllm_draft, final, renamed)


def _deployment_spec(ctx: StageContext, plan: _Plan, ddraft: _DeployedDraft) -> DeploymentSpec:
    """The section's limits (defaults from tune and the models' positions), KV cache and CUDA graphs."""
    from runtime.trtllm import options as T
    from runtime.trtllm.checks import draft_positions

    sec: Config = ctx.section
    mbs = plan.mbs
    mnt = sec.max_num_tokens or plan.tuning.max_num_tokens or mbs * (1 + plan.kmax)
    positions = [p for p in (plan.tcfg.get("max_position_embeddings"),
                             draft_positions(plan.dcfg) if plan.dcfg else None) if p]
    msl, chunked = T.prompt_limits(int(mnt), sec.max_seq_len, min(positions) if positions else 2048, sec.chunked_prefill,
                                   ctx.log)
    kv = {"free_gpu_memory_fraction": sec.kv_cache.free_gpu_memory_fraction,
          "enable_block_reuse": sec.kv_cache.enable_block_reuse}
    if sec.kv_cache.dtype == "fp8":
        kv["dtype"] = "fp8"
    cg = None
    if sec.cuda_graphs:
        cg = [b for b in plan.tuning.cuda_graph_batch_sizes if b <= mbs] or [1]
    guard = sec.acceptance_guard
    sa, sa_note = T.sa_config_of(plan.tuning.raw, plan.version, plan.algo, plan.speculation)
    ctx.log.info("sa_config (suffix-automaton enhancer): %s", sa_note)
    return T.DeploymentSpec(
        version=plan.version, algorithm=plan.algo, draft_dir=str(ddraft.final) if ddraft.dir else "",
        schedule=plan.schedule, capture_layers=plan.capture_layers, sa_config=sa, sa_note=sa_note,
        max_batch_size=mbs, max_num_tokens=int(mnt), max_seq_len=int(msl), cuda_graph_batch_sizes=cg, kv_cache=kv,
        eagle3_one_model=sec.eagle3_mode == "one_model", tensor_parallel_size=ctx.config.hardware.tensor_parallel_size,
        pipeline_parallel_size=sec.pipeline_parallel_size,
        acceptance_window=guard.window if guard else None, min_acceptance_rate=guard.min_acceptance_rate if guard else None,
        enable_chunked_prefill=chunked)


def _llm_api_options(spec: DeploymentSpec, version: str) -> dict:
    from runtime.trtllm import options as T

    try:
        return T.llm_api_options(spec)
    except ValueError as e:   # draft_schedule.UnsupportedSchedule: tune and build disagree on what the version runs
        raise StageError(f"the tuned draft-length schedule cannot be written for TensorRT-LLM {version}: {e}; "
                         "rerun tune (specpipe build --from tune)") from None


def _checked(ctx: StageContext, plan: _Plan, options: dict, ddraft: _DeployedDraft) -> list[Check]:
    """Run the named consistency checks, log each; a failed one fails the stage with its message."""
    from runtime import hf_config
    from runtime.trtllm.checks import Expected, consistency_checks

    tcfg = plan.tcfg
    checks = consistency_checks(
        options, version=plan.version, algorithm=plan.algo, target_dir=plan.target_dir, draft_dir=ddraft.dir,
        expected=Expected(
            target_vocab_size=tcfg.get("vocab_size"), target_hidden_size=tcfg.get("hidden_size"),
            num_target_layers=int(tcfg.get("num_hidden_layers") or 0) or None,
            capture_layers=plan.capture_layers, schedule=plan.schedule,
            target_rope_theta=hf_config.theta_of(ctx.input("target").path / "model" / "config.json"),
            draft_rope_theta=(hf_config.theta_of(ctx.input("train_draft").path / "draft" / "config.json")
                              if plan.speculation else None)))
    for c in checks:
        ctx.log.info("check %-28s %s  %s", c.name, "ok  " if c.ok else "FAIL", c.message)
    failed = [c for c in checks if not c.ok]
    if failed:
        raise StageError("deployment consistency checks failed:\n" + "\n".join(f"  {c.name}: {c.message}" for c in failed)
                         + ("\n  (config.json RoPE fields are written by quantize and train_draft: rerun them if their "
                            "artifacts predate that)" if any(c.name.endswith("_rope") for c in failed) else ""))
    return checks


def _write_options_and_commands(ctx: StageContext, plan: _Plan, options: dict, out: Path) -> _Bench:
    """llm_api_options.yaml, the bench dataset, serve.sh and bench.sh."""
    from runtime.trtllm import commands as C
    from runtime.trtllm import options as T

    sec: Config = ctx.section
    (out / "llm_api_options.yaml").write_text(T.options_yaml(options, plan.version))
    concurrency = sec.bench.concurrency or plan.mbs
    prompts = [(p, domain) for domain, ps in data_artifact.read_eval(ctx.input("data").path).items() for p in ps]
    n_prompts, n_requests = C.write_bench_dataset(prompts, out / "bench_dataset.jsonl", sec.bench.output_tokens,
                                                  sec.bench.rounds * concurrency)
    bench_name = sec.bench.model_name or C.bench_model_name(plan.tcfg, ctx.workdir)
    C.write_script(out / "serve.sh", C.serve_command(plan.target_dir))
    C.write_script(out / "bench.sh", C.bench_command(bench_name, plan.target_dir, concurrency))
    return _Bench(concurrency, n_prompts, n_requests, bench_name)


def _runs(plan: _Plan, options: dict) -> DraftSchedule:
    """The draft length per batch size the written options make TensorRT-LLM run (0 without speculation)."""
    from runtime.trtllm import draft_schedule

    sc = options.get("speculative_config") or {}
    return draft_schedule.decode(sc, plan.rel, plan.mode, plan.mbs) if sc else DraftSchedule.constant(0)


def _deployment_doc(ctx: StageContext, plan: _Plan, options: dict, ddraft: _DeployedDraft,
                    guard: tuple[dict, str | None], bench: _Bench, checks: list[Check], loaded: dict) -> DeploymentInfo:
    """deployment.json's record: what was written, for `export`, `status` and the README."""
    sc = options.get("speculative_config") or {}
    guard_doc, guard_note = guard
    return DeploymentInfo(
        trtllm_version=plan.version, serving_image=compat.serving_image_for(plan.version), backend="pytorch",
        algorithm=plan.algo, mode=plan.mode, speculation=plan.speculation, decoding_type=sc.get("decoding_type"),
        target_dir=str(plan.target_dir),
        # draft_dir: the draft as train_draft/quantize wrote it (specpipe's runtime reads it); trtllm_draft_dir: the
        # one TensorRT-LLM loads (layer names of the targeted version)
        draft_dir=str(plan.draft_src) if plan.speculation else None,
        trtllm_draft_dir=str(ddraft.final) if ddraft.dir else None,
        draft_weight_names=({"renamed": ddraft.renamed, "from": "layers.<i>.*", "to": "midlayer.*",
                             "dir": "deployment/draft"} if ddraft.renamed else None),
        eagle3_layers_to_capture=sc.get("eagle3_layers_to_capture"),
        max_draft_len=plan.kmax, max_batch_size=plan.mbs, max_num_tokens=options["max_num_tokens"],
        max_seq_len=options["max_seq_len"], enable_chunked_prefill=bool(options.get("enable_chunked_prefill")),
        draft_schedule=_runs(plan, options), schedule_note=plan.tuning.deployment.get("note"),
        acceptance_guard=guard_doc or None, acceptance_guard_note=guard_note,
        options_file="deployment/llm_api_options.yaml", bench=asdict(bench), load=loaded,
        checks=tuple(CheckRow(c.name, c.ok, c.message) for c in checks),
        workdir=str(Path(ctx.workdir).resolve()))


# ---------------------------------------------------------------------------------------------- report


def report(artifact: Artifact) -> str:
    from pipeline.report import esc, figure, table

    doc = build_artifact.read_deployment(artifact.path).raw
    sched = DraftSchedule.from_json(doc["draft_schedule"])
    html = (f"<p>TensorRT-LLM {esc(doc['trtllm_version'])} ({esc(doc['serving_image'])}), "
            f"{esc(doc['decoding_type'] or 'no speculation')} {esc(doc['mode'])}: "
            f"{esc(sched.describe(doc['max_batch_size']))}; "
            f"{esc('loaded' if doc['load']['loaded'] else doc['load']['reason'])}</p>")
    if doc.get("schedule_note"):
        html += f"<p>{esc(doc['schedule_note'])}</p>"
    if ng := doc.get("ngram"):
        html += f"<p>n-gram deployment in {esc(ng['dir'])}: {esc(str(ng['settings']))}; pays more than the trained draft " \
                f"on: {esc(', '.join(ng['ngram_pays_more_on']) or 'no domain')} (validate)</p>"
    html += table([{"check": c["name"], "result": "ok" if c["ok"] else "FAILED", "detail": c["message"]} for c in doc["checks"]])
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 2.6))
    ks = sched.ks(doc["max_batch_size"])
    ax.step(range(1, len(ks) + 1), ks, where="mid")
    ax.set_xlabel("batch size"), ax.set_ylabel("draft length")
    ax.set_title("draft length TensorRT-LLM uses (written options)")
    return html + figure(fig)
