"""Stage `build`: the TensorRT-LLM deployment of the FP8 target and its draft.

For EAGLE-3 and DFlash TensorRT-LLM has no engine build: they run in the PyTorch backend (LLM API), where
the deployment is the checkpoint pair plus the LLM-API options (CUDA graphs are captured when `LLM(...)`
starts). So this stage writes, for the TensorRT-LLM version it targets (`build.trtllm_version`, default the
version the shipped Triton image pins, `runtime/compat.py`):

  deployment/llm_api_options.yaml   speculative_config (+ tuned schedule), batch/token/sequence limits, KV, CUDA graphs
  deployment/serve.sh               trtllm-serve <FP8 target> --backend pytorch --extra_llm_api_options ...
  deployment/bench.sh               trtllm-bench throughput on bench_dataset.jsonl (the eval prompts)
  deployment/bench_dataset.jsonl    {"task_id", "prompt", "input_ids", "output_tokens", "category"} per prompt
  deployment/README.md              what was built, for which version/container, the checks, how to run it
  deployment.json                   the same facts for `export` and `status`

Every key is checked against the version's field list, and the named consistency checks of
`runtime.trtllm_options.consistency_checks` must pass (a failed check fails the stage with its message).
Where `tensorrt_llm` imports and a CUDA GPU exists, `LLM(...)` is instantiated from the written options and a
short generation is run; elsewhere the stage records plainly that the deployment was written, not loaded.
"""
from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from pipeline.errors import StageError
from pipeline.stage import Artifact, StageContext, StageSection, Strict
from runtime import compat

NAME = "build"
CONSUMES: tuple[str, ...] = ("data", "train_draft", "quantize", "tune")
VERSION = "1"
PACKAGES = ("tensorrt_llm",)
USES = ("hardware",)

NOT_LOADED = "TensorRT-LLM not available: deployment written, not loaded"


class KvCache(Strict):
    free_gpu_memory_fraction: float = Field(0.85, gt=0, le=1, description="GPU memory left after weights given to the KV cache")
    enable_block_reuse: bool = Field(True, description="reuse KV blocks across requests with a shared prefix")
    dtype: Literal["auto", "fp8"] = Field("auto", description="auto: follow the target's hf_quant_config.json")


class AcceptanceGuard(Strict):
    """Switch speculation off for good when the rolling acceptance rate drops below a floor (written in the
    targeted version's terms: 1.2 thresholds an acceptance length, 1.3 a rate)."""

    window: int = Field(ge=1, description="1.2: completed requests; 1.3: speculation-enabled iterations")
    min_acceptance_rate: float = Field(ge=0, le=1, description="accepted / drafted; 1.2 gets 1 + rate x max_draft_len as a length")


class Bench(Strict):
    output_tokens: int = Field(128, ge=1, description="output tokens per bench request")
    concurrency: int | None = Field(None, ge=1, description="default: max_batch_size")
    model_name: str | None = Field(None, description="trtllm-bench --model (a name, not a path); default from the target")


class Config(StageSection):
    backend: Literal["pytorch", "tensorrt"] = Field("pytorch", description=(
        "TensorRT-LLM backend; EAGLE-3 and DFlash run only in pytorch (the LLM API), tensorrt is refused"))
    trtllm_version: str = Field(compat.DEFAULT_TRTLLM_VERSION, description=(
        "TensorRT-LLM whose field names and semantics are written; default: the version the shipped Triton image pins"))
    eagle3_mode: Literal["one_model", "two_model"] = Field("one_model", description=(
        "two_model (1.2 only) also writes disable_overlap_scheduler: true"))
    max_batch_size: int | None = Field(None, ge=1, description="default: from tune")
    max_num_tokens: int | None = Field(None, ge=1, description="default: from tune")
    max_seq_len: int | None = Field(None, ge=16, description="default: min(target, draft) positions")
    kv_cache: KvCache = Field(default_factory=KvCache)
    cuda_graphs: bool = Field(True, description="CUDA-graph batch sizes from tune (schedule boundaries included)")
    pipeline_parallel_size: int = Field(1, ge=1, description="> 1 is refused: speculation is incompatible with pipeline parallelism")
    acceptance_guard: AcceptanceGuard | None = Field(None, description="switch speculation off when acceptance collapses")
    bench: Bench = Field(default_factory=Bench, description="trtllm-bench command and dataset")
    load: Literal["auto", "never"] = Field("auto", description="auto: instantiate LLM(...) where TensorRT-LLM and a GPU exist")

    @field_validator("trtllm_version", mode="before")
    @classmethod
    def _known_version(cls, v):
        return compat.normalize_version(v)  # ValueError names the supported lines


def _algorithm(cfg) -> str | None:
    """The draft algorithm the config trains (train_draft owns the field; read defensively)."""
    td = getattr(cfg, "train_draft", None)
    for obj in (td, getattr(td, "draft", None), getattr(td, "algorithm", None)):
        for attr in ("algorithm", "kind"):
            v = getattr(obj, attr, None)
            if isinstance(v, str):
                return v.lower()
        if isinstance(obj, str):
            return obj.lower()
    return None


def check(cfg) -> list[tuple[str, str]]:
    sec: Config = cfg.build
    algo = _algorithm(cfg) or "eagle3"
    out: list[tuple[str, str]] = []
    if sec.backend == "tensorrt":
        out.append(("build.backend", (
            f"the TensorRT-engine path (trtllm-build --speculative_decoding_mode draft_tokens_external|lookahead_decoding|"
            f"medusa|explicit_draft_tokens|eagle) serves EAGLE-1/2, Medusa, ReDrafter, Lookahead and draft/target only; "
            f"{'EAGLE-3' if algo == 'eagle3' else 'DFlash'} runs only in the PyTorch backend (LLM API), and the engine "
            "backend gets no new features: set build.backend: pytorch")))
    if (p := compat.algorithm_problem(sec.trtllm_version, algo)) is not None:
        out.append(("build.trtllm_version", p))
    rel = compat.release(sec.trtllm_version)
    if algo == "eagle3" and sec.eagle3_mode == "two_model" and not rel.eagle3_two_model:
        out.append(("build.eagle3_mode", f"TensorRT-LLM {sec.trtllm_version} always runs EAGLE-3 as one model "
                                         "(eagle3_one_model: false is reset to true); use one_model or a 1.2 version"))
    if sec.pipeline_parallel_size > 1:
        out.append(("build.pipeline_parallel_size", "speculative decoding is incompatible with pipeline parallelism "
                                                    "in TensorRT-LLM; use hardware.tensor_parallel_size instead"))
    return out


# ---------------------------------------------------------------------------------------------- run


def run(ctx: StageContext) -> dict:
    from runtime import trtllm_options as T

    sec: Config = ctx.section
    arts = ctx.input("quantize").path.parent          # <workdir>/artifacts: quantize.json paths are relative to it
    quant = ctx.input("quantize").read_json("quantize.json")
    target_dir = (arts / quant["target_dir"]).resolve()
    draft_dir = (arts / quant["draft_dir"]).resolve()
    draft = ctx.input("train_draft").read_json("draft.json")
    tuning = ctx.input("tune").read_json("tuning.json")
    tcfg = json.loads((target_dir / "config.json").read_text())
    dcfg = json.loads((draft_dir / "config.json").read_text())
    algo = str(draft.get("algorithm", "eagle3")).lower()
    if (p := compat.algorithm_problem(sec.trtllm_version, algo)) is not None:
        raise StageError(p)

    max_draft_len = int(tuning.get("max_draft_len") or draft.get("trained_draft_len") or 0)
    if max_draft_len <= 0:
        raise StageError("tune found no draft length that pays off at batch 1 (max_draft_len 0): a speculative "
                         "deployment would only add cost; check acceptance.json and tuning.json")
    mbs = sec.max_batch_size or int(tuning.get("max_batch_size") or 64)
    intervals = _tuned_intervals(tuning, max_draft_len)
    mc = tuning.get("max_concurrency")
    mnt = sec.max_num_tokens or tuning.get("max_num_tokens") or mbs * (1 + max_draft_len)
    positions = [p for p in (tcfg.get("max_position_embeddings"), T._draft_positions(dcfg)) if p]
    msl = sec.max_seq_len or (min(positions) if positions else 2048)
    kv = {"free_gpu_memory_fraction": sec.kv_cache.free_gpu_memory_fraction,
          "enable_block_reuse": sec.kv_cache.enable_block_reuse}
    if sec.kv_cache.dtype == "fp8":
        kv["dtype"] = "fp8"
    cg = None
    if sec.cuda_graphs:
        cg = [int(b) for b in (tuning.get("cuda_graph_batch_sizes") or [1, 2, 4, 8]) if int(b) <= mbs] or [1]
    guard = sec.acceptance_guard
    spec = T.DeploymentSpec(
        version=sec.trtllm_version, algorithm=algo, draft_dir=str(draft_dir), max_draft_len=max_draft_len,
        num_target_layers=int(tcfg.get("num_hidden_layers") or draft.get("num_target_layers") or 0),
        aux_layer_ids=draft.get("aux_layer_ids") if algo == "eagle3" else None,
        max_batch_size=mbs, max_num_tokens=int(mnt), max_seq_len=int(msl), schedule=intervals,
        max_concurrency=int(mc) if mc else None, cuda_graph_batch_sizes=cg, kv_cache=kv,
        eagle3_one_model=sec.eagle3_mode == "one_model", tensor_parallel_size=ctx.config.hardware.tensor_parallel_size,
        pipeline_parallel_size=sec.pipeline_parallel_size,
        acceptance_window=guard.window if guard else None, min_acceptance_rate=guard.min_acceptance_rate if guard else None)
    options = T.llm_api_options(spec)
    checks = T.consistency_checks(options, version=sec.trtllm_version, algorithm=algo, target_dir=target_dir,
                                  draft_dir=draft_dir, target_vocab_size=tcfg.get("vocab_size"))
    for c in checks:
        ctx.log.info("check %-28s %s  %s", c.name, "ok  " if c.ok else "FAIL", c.message)
    failed = [c for c in checks if not c.ok]
    if failed:
        raise StageError("deployment consistency checks failed:\n" + "\n".join(f"  {c.name}: {c.message}" for c in failed))

    out = ctx.out_dir / "deployment"
    out.mkdir(parents=True)
    (out / "llm_api_options.yaml").write_text(
        f"# LLM-API options for TensorRT-LLM {sec.trtllm_version} (PyTorch backend), written by specpipe build.\n"
        f"# Use: trtllm-serve <target> --backend pytorch --extra_llm_api_options llm_api_options.yaml\n"
        + T.dump_yaml(options))
    n_prompts = _bench_dataset(ctx.input("data").path / "eval", out / "bench_dataset.jsonl", sec.bench.output_tokens)
    image = compat.serving_image_for(sec.trtllm_version)
    bench_name = sec.bench.model_name or _model_name(tcfg, ctx.workdir)
    _write_script(out / "serve.sh", serve_command(target_dir))
    _write_script(out / "bench.sh", bench_command(bench_name, target_dir, sec.bench.concurrency or mbs))
    loaded = _try_load(sec, target_dir, options, ctx) if sec.load == "auto" else {"loaded": False, "reason": "build.load: never"}
    ctx.log.info("load: %s", "loaded" if loaded["loaded"] else loaded["reason"])
    from runtime.costmodel import runs as runs_of_k

    by_batch = [list(r) for r in runs_of_k([_k_at(options["speculative_config"], b, sec.trtllm_version, max_draft_len) for b in range(1, mbs + 1)])]
    doc = {
        "trtllm_version": sec.trtllm_version, "serving_image": image, "backend": "pytorch", "algorithm": algo,
        "decoding_type": options["speculative_config"]["decoding_type"], "target_dir": str(target_dir),
        "draft_dir": str(draft_dir), "max_draft_len": max_draft_len, "max_batch_size": mbs,
        "max_num_tokens": options["max_num_tokens"], "max_seq_len": options["max_seq_len"],
        "draft_len_by_batch": by_batch, "options_file": "deployment/llm_api_options.yaml",
        "bench_prompts": n_prompts, "bench_model_name": bench_name,
        "checks": [{"name": c.name, "ok": c.ok, "message": c.message} for c in checks], "load": loaded,
        "workdir": str(Path(ctx.workdir).resolve()),
    }
    (ctx.out_dir / "deployment.json").write_text(json.dumps(doc, indent=2))
    (out / "README.md").write_text(_readme(doc, options))
    ctx.log.info("deployment for TensorRT-LLM %s (%s): %s k=%d, batch<=%d, %d bench prompts",
                 sec.trtllm_version, image, doc["decoding_type"], max_draft_len, mbs, n_prompts)
    return {"trtllm_version": sec.trtllm_version, "decoding_type": doc["decoding_type"], "max_draft_len": max_draft_len,
            "max_batch_size": mbs, "max_num_tokens": options["max_num_tokens"], "checks_passed": len(checks),
            "loaded": loaded["loaded"], "load_note": loaded.get("reason", "loaded"), "bench_prompts": n_prompts}


def _tuned_intervals(tuning: dict, max_draft_len: int):
    """The tuned draft length per batch size, decoded from tuning.json in the semantics of the version tune
    wrote it for (not necessarily the version built here)."""
    from runtime import trtllm_options as T

    runs = tuning.get("draft_len_by_batch")   # [[first batch, last batch, k], ...]: the step function itself
    if runs and all(isinstance(r, (list, tuple)) and len(r) == 3 for r in runs):
        iv = [(int(lo), int(hi), int(k)) for lo, hi, k in runs]
        return T.merge_intervals(iv[:-1] + [(iv[-1][0], None, iv[-1][2])])   # the last run extends past tune's table
    sched = tuning.get("draft_len_schedule")
    if not sched:
        return None
    src = tuning.get("trtllm_version") or compat.DEFAULT_TRTLLM_VERSION
    return T.schedule_to_intervals({int(k): int(v) for k, v in sched.items()}, compat.release(src).schedule_semantics)


def _k_at(sc: dict, batch: int, version: str, max_draft_len: int) -> int:
    """Draft length TensorRT-LLM uses at this batch size under the written options (for the report)."""
    from runtime import trtllm_options as T

    k = max_draft_len
    if sc.get("draft_len_schedule"):
        for lo, hi, kk in T.schedule_to_intervals(sc["draft_len_schedule"], compat.release(version).schedule_semantics):
            if lo <= batch and (hi is None or batch <= hi):
                k = kk
    if sc.get("max_concurrency") and batch > sc["max_concurrency"]:
        k = 0
    return k


def _model_name(tcfg: dict, workdir: Path) -> str:
    """trtllm-bench wants a model *name* (it rejects paths; the checkpoint goes to --model_path)."""
    name = tcfg.get("_name_or_path") or ""
    return name if name and not Path(name).exists() and "/" in name else f"specpipe/{Path(workdir).resolve().name}-target"


def _bench_dataset(eval_dir: Path, path: Path, output_tokens: int) -> int:
    """trtllm-bench's dataset format (tensorrt_llm/bench/dataclasses/general.py InferenceRequest)."""
    n = 0
    with open(path, "w") as f:
        for domain_file in sorted(eval_dir.glob("*.jsonl")):
            for line in domain_file.read_text().splitlines():
                if not line.strip():
                    continue
                p = json.loads(line)
                f.write(json.dumps({"task_id": n, "prompt": p["prompt"], "input_ids": p.get("prompt_ids"),
                                    "output_tokens": output_tokens, "category": domain_file.stem}) + "\n")
                n += 1
    if n == 0:
        raise StageError(f"no evaluation prompts in {eval_dir} for the bench dataset")
    return n


# ---------------------------------------------------------------------------------------------- command files


_PREAMBLE = ('#!/usr/bin/env bash\n# Written by specpipe build. Paths are shell-quoted; this file can be run from anywhere.\n'
             'set -euo pipefail\nHERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"\n')


def serve_command(target_dir: Path) -> str:
    return (_PREAMBLE + 'exec trtllm-serve ' + shlex.quote(str(target_dir)) + ' \\\n'
            '  --backend pytorch --host "${HOST:-127.0.0.1}" --port "${PORT:-8000}" \\\n'
            '  --extra_llm_api_options "$HERE/llm_api_options.yaml" "$@"\n')


def bench_command(model_name: str, target_dir: Path, concurrency: int) -> str:
    return (_PREAMBLE + 'exec trtllm-bench --model ' + shlex.quote(model_name) + ' --model_path '
            + shlex.quote(str(target_dir)) + ' \\\n'
            '  throughput --backend pytorch --dataset "$HERE/bench_dataset.jsonl" \\\n'
            '  --extra_llm_api_options "$HERE/llm_api_options.yaml" \\\n'
            f'  --concurrency {int(concurrency)} --report_json "${{REPORT:-$HERE/bench_report.json}}" "$@"\n')


def _write_script(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


# ---------------------------------------------------------------------------------------------- load


def _try_load(sec: Config, target_dir: Path, options: dict, ctx: StageContext) -> dict:
    """Instantiate LLM(...) from the written options where TensorRT-LLM and a GPU exist; never faked."""
    try:
        import tensorrt_llm  # noqa: F401
    except ImportError:
        return {"loaded": False, "reason": NOT_LOADED}
    import torch

    if not torch.cuda.is_available():
        return {"loaded": False, "reason": "TensorRT-LLM imports but no CUDA GPU: deployment written, not loaded"}
    from tensorrt_llm import LLM, SamplingParams
    from tensorrt_llm.llmapi.llm_utils import update_llm_args_with_extra_dict

    args = update_llm_args_with_extra_dict({"model": str(target_dir), "backend": "pytorch"}, options)
    llm = LLM(**args)
    try:
        out = llm.generate(["def fibonacci(n):"], SamplingParams(max_tokens=32, return_perf_metrics=True))[0]
        sd = out.outputs[0].request_perf_metrics.speculative_decoding
        return {"loaded": True, "tensorrt_llm": tensorrt_llm.__version__, "warmup_text": out.outputs[0].text,
                "acceptance_rate": sd.acceptance_rate, "total_draft_tokens": sd.total_draft_tokens,
                "total_accepted_draft_tokens": sd.total_accepted_draft_tokens}
    finally:
        llm.shutdown()


# ---------------------------------------------------------------------------------------------- README / report


def _readme(doc: dict, options: dict) -> str:
    from runtime import trtllm_options as T

    rows = "\n".join(f"| `{c['name']}` | {'ok' if c['ok'] else 'FAILED'} | {c['message']} |" for c in doc["checks"])
    return f"""# TensorRT-LLM deployment (written by specpipe build)

- TensorRT-LLM **{doc['trtllm_version']}**, PyTorch backend (LLM API); container: `{doc['serving_image']}`
- speculative decoding: `{doc['decoding_type']}`, max_draft_len {doc['max_draft_len']}; draft length per batch size
  ({'; '.join(f"{lo}-{hi}: {k}" for lo, hi, k in doc['draft_len_by_batch'])})
- FP8 target: `{doc['target_dir']}`
- draft: `{doc['draft_dir']}`
- loaded here: {'yes' if doc['load']['loaded'] else 'no — ' + doc['load']['reason']}

There is no engine build for EAGLE-3/DFlash: `LLM(...)` loads the checkpoint pair with these options and
captures CUDA graphs / autotunes kernels at startup.

## Run
```bash
./serve.sh                      # OpenAI-compatible server on ${{HOST:-127.0.0.1}}:${{PORT:-8000}}
./bench.sh                      # trtllm-bench throughput on bench_dataset.jsonl ({doc['bench_prompts']} eval prompts)
```
In the container, mount the run directory at the same absolute path (the scripts and the options name the
checkpoints by absolute path):
```bash
docker run --gpus all --rm -it --ipc=host -p 8000:8000 -e HOST=0.0.0.0 \\
  -v {shlex.quote(doc['workdir'])}:{shlex.quote(doc['workdir'])} {doc['serving_image']} \\
  {shlex.quote(doc['workdir'] + '/artifacts/build/deployment/serve.sh')}
```
`trtllm-bench` prints a `DECODING STATISTICS` block (acceptance length `[AL]`, draft acceptance rate `[DAR]`).

## llm_api_options.yaml
```yaml
{T.dump_yaml(options).rstrip()}
```

## Consistency checks
| check | result | detail |
|---|---|---|
{rows}
"""


def report(artifact: Artifact) -> str:
    from pipeline.report import esc, figure, table

    doc = artifact.read_json("deployment.json")
    html = (f"<p>TensorRT-LLM {esc(doc['trtllm_version'])} ({esc(doc['serving_image'])}), {esc(doc['decoding_type'])}, "
            f"max_draft_len {doc['max_draft_len']}; {esc('loaded' if doc['load']['loaded'] else doc['load']['reason'])}</p>")
    html += table([{"check": c["name"], "result": "ok" if c["ok"] else "FAILED", "detail": c["message"]} for c in doc["checks"]])
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 2.6))
    ks = [k for lo, hi, k in doc["draft_len_by_batch"] for _ in range(lo, hi + 1)]
    ax.step(range(1, len(ks) + 1), ks, where="mid")
    ax.set_xlabel("batch size")
    ax.set_ylabel("draft length")
    ax.set_title("draft length TensorRT-LLM uses (written options)")
    return html + figure(fig)
