"""Published GPU runs as data, and the cost model applied to them (`specpipe predict FILE`).

A record (bench/published_runs.yaml is the project's; a user may write their own in the same schema) holds:
- `shapes`: model shapes by key (`kind: target` for a Llama-style decoder, `kind: eagle3` for a one-layer EAGLE-3
  drafter, `kind: dflash` for a DFlash block drafter: `feature_layers` target layers fused by `fc`, plain layers,
  lm_head over the full vocabulary), each with the source it was read from;
- `runs`: one row a published run (engine, GPU key of pipeline/hardware.py, tensor parallelism, target and drafter
  shape keys, dtype, the speculation shape (`steps`, `topk`, `num_draft_tokens`: a chain when topk is 1),
  batch, and `measured`: what the source printed, among `al`, `base_tokens_per_s`, `spec_tokens_per_s`, `speedup`);
  `drafter.algorithm` (eagle3, the default, or dflash) must match its shape's kind: a DFlash run is a chain of
  `steps` = the drafted tokens a step (num_speculative_tokens), priced as one parallel draft pass
  (runtime.cost.costmodel.Deployment.draft_time);
- `excluded`: runs read but kept out, each with its reason.

Pricing a run is what `tune` does (runtime.cost.costmodel at tune's default efficiencies), plus the per-step
engine overheads of runtime.cost.engine_fit where given: plain step = scale x T_target(B, 1) + step; speculative
step = spec_scale x (T_target(B, 1+k) + T_draft(B, k)) (a tree: runtime.cost.costmodel.Deployment.tree_time) + step +
verify + steps x (draft_pass + tree_pass where topk > 1). Throughputs are batch x tokens per step / step time.

Errors in a record are RuntimeUsageError naming the file, the run and the field (the CLI exits 2).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from runtime.algorithms.registry import ALGORITHMS
from runtime.cost import costmodel as cm
from runtime.errors import RuntimeUsageError

ENGINES = ("sglang", "vllm", "trtllm")
DTYPES = {"bf16": 2.0, "fp16": 2.0, "fp8": 1.0}
MEASURED = ("al", "base_tokens_per_s", "spec_tokens_per_s", "speedup")
DEFAULT_CONTEXT = 1024     # a run that prints no context length: MT-Bench-sized prompts and answers (said as assumed)


@dataclass(frozen=True)
class Run:
    id: str
    engine: str
    gpu: str
    tp: int
    target: str
    draft: str | None
    dtype: str
    steps: int              # draft depth (chain: k); 0 = no speculation priced
    topk: int
    nodes: int              # tokens verified per sequence and step (root included); chain: 1 + steps
    batch: int
    context: int
    measured: dict
    source: str = ""
    assumed: tuple = ()
    algorithm: str = "eagle3"     # the drafter's: "eagle3" | "dflash"

    @property
    def is_tree(self) -> bool:
        return self.topk > 1

    def published_speedup(self) -> float | None:
        m = self.measured
        if m.get("spec_tokens_per_s") and m.get("base_tokens_per_s"):
            return m["spec_tokens_per_s"] / m["base_tokens_per_s"]
        return m.get("speedup")


@dataclass
class Record:
    path: str
    shapes: dict
    runs: list[Run]
    sources: dict = field(default_factory=dict)
    excluded: list = field(default_factory=list)


@dataclass(frozen=True)
class Overheads:
    """What a serving engine adds beside the model's kernels: `scale` multiplies the modelled kernel time of a plain
    decode step and `spec_scale` that of a speculative step (target verification and draft passes): the datasheet
    rates at tune's efficiencies are more than an engine reaches, and a step of several rows per sequence reaches
    less than a one-row step. The rest are fixed seconds."""

    step: float = 0.0         # every target forward step: scheduler, sampler, launch and sync
    verify: float = 0.0       # every speculative step: accept/reject, KV and tree bookkeeping
    draft_pass: float = 0.0   # every draft forward pass: the draft loop's per-token work
    tree_pass: float = 0.0    # every draft pass of a tree (topk > 1) besides: top-k expansion, tree masks
    scale: float = 1.0
    spec_scale: float = 1.0


# ------------------------------------------------------------------------------------------ reading


def _need(where: str, d: dict, key: str, kind, *, positive: bool = False):
    v = d.get(key)
    ok = isinstance(v, kind) and not isinstance(v, bool) and (not positive or v > 0)
    if not ok:
        want = {int: "an integer", float: "a number", str: "a string", dict: "a mapping"}.get(kind, "a number")
        raise RuntimeUsageError(f"{where}: field '{key}' must be {want}{' > 0' if positive else ''}, found {v!r}")
    return v


def _shape(path: str, key: str, d) -> cm.ModelShape:
    where = f"{path}: shape '{key}'"
    if not isinstance(d, dict):
        raise RuntimeUsageError(f"{where}: must be a mapping of the model's dimensions")
    kind = d.get("kind")
    dims = {k: _need(where, d, k, int, positive=True)
            for k in ("num_layers", "hidden", "heads", "kv_heads", "intermediate", "vocab")}
    hd = d.get("head_dim") or dims["hidden"] // dims["heads"]
    if kind == "target":
        return cm.llama(key, num_layers=dims["num_layers"], hidden=dims["hidden"], heads=dims["heads"],
                        kv_heads=dims["kv_heads"], intermediate=dims["intermediate"], vocab=dims["vocab"], head_dim=hd)
    algo = ALGORITHMS.get(kind) if isinstance(kind, str) else None   # a draft's shape: its kind is its algorithm
    if algo is not None and algo.drafts_block:
        th = _need(where, d, "target_hidden", int, positive=True)
        n_feat = _need(where, d, "feature_layers", int, positive=True)
        h = dims["hidden"]
        return cm.ModelShape(key, dims["num_layers"], h, dims["heads"], dims["kv_heads"], hd,
                             cm.llama_layer_gemms(h, dims["heads"], dims["kv_heads"], hd, dims["intermediate"]),
                             head_gemms=(cm.Gemm("lm_head", h, dims["vocab"]),),
                             input_gemms=(cm.Gemm("fc", n_feat * th, h, split=False),))
    if algo is not None and algo.takes_hidden_states:
        th = _need(where, d, "target_hidden", int, positive=True)
        dv = d.get("draft_vocab") or dims["vocab"]
        h = dims["hidden"]
        return cm.ModelShape(key, dims["num_layers"], h, dims["heads"], dims["kv_heads"], hd,
                             cm.llama_layer_gemms(h, dims["heads"], dims["kv_heads"], hd, dims["intermediate"], qkv_in=2 * h),
                             head_gemms=(cm.Gemm("lm_head", h, dv),),
                             input_gemms=(cm.Gemm("fc", 3 * th, h, split=False),))
    raise RuntimeUsageError(f"{where}: field 'kind' must be 'target', 'eagle3' or 'dflash', found {kind!r}")


def _run(path: str, i: int, d, shapes: dict, gpus, kinds: dict) -> Run:
    if not isinstance(d, dict):
        raise RuntimeUsageError(f"{path}: runs[{i}] must be a mapping, found {type(d).__name__}")
    rid = d.get("id") if isinstance(d.get("id"), str) else f"#{i}"
    where = f"{path}: run '{rid}' (runs[{i}])"
    _need(where, d, "id", str)
    engine = _need(where, d, "engine", str)
    if engine not in ENGINES:
        raise RuntimeUsageError(f"{where}: field 'engine' must be one of {', '.join(ENGINES)}, found {engine!r}")
    gpu = _need(where, d, "gpu", str)
    if gpu not in gpus:
        raise RuntimeUsageError(f"{where}: field 'gpu' {gpu!r} is not in the GPU table (pipeline/hardware.py): "
                                f"{', '.join(sorted(gpus))}")
    target = _need(where, d, "target", str)
    if target not in shapes:
        raise RuntimeUsageError(f"{where}: field 'target' {target!r} names no entry of 'shapes'")
    dtype = d.get("dtype", "bf16")
    if dtype not in DTYPES:
        raise RuntimeUsageError(f"{where}: field 'dtype' must be one of {', '.join(DTYPES)}, found {dtype!r}")
    measured = _measured(where, d.get("measured"))
    steps, topk, nodes, draft, algorithm = _spec(where, d, shapes, kinds)
    tp = d.get("tp", 1)
    batch = d.get("batch")
    for k, v in (("tp", tp), ("batch", batch), ("context", d.get("context", DEFAULT_CONTEXT))):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise RuntimeUsageError(f"{where}: field '{k}' must be an integer >= 1, found {v!r}")
    return Run(rid, engine, gpu, tp, target, draft, dtype, steps, topk, nodes, batch,
               d.get("context", DEFAULT_CONTEXT), measured, str(d.get("source", "")), tuple(d.get("assumed") or ()),
               algorithm)


def _measured(where: str, m) -> dict:
    if not isinstance(m, dict) or not m:
        raise RuntimeUsageError(f"{where}: field 'measured' must map some of {', '.join(MEASURED)} to numbers")
    unknown = sorted(set(m) - set(MEASURED))
    if unknown:
        raise RuntimeUsageError(f"{where}: field 'measured.{unknown[0]}' is not one of {', '.join(MEASURED)}")
    for k, v in m.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
            raise RuntimeUsageError(f"{where}: field 'measured.{k}' must be a number > 0, found {v!r}")
    if "al" in m and m["al"] < 1:
        raise RuntimeUsageError(f"{where}: field 'measured.al' is an acceptance length (>= 1), found {m['al']!r}")
    return dict(m)


def _spec(where: str, d: dict, shapes: dict, kinds: dict):
    spec = d.get("spec")
    if spec is None:
        return 0, 1, 1, None, "eagle3"
    if not isinstance(spec, dict):
        raise RuntimeUsageError(f"{where}: field 'spec' must be a mapping (steps, topk, num_draft_tokens)")
    steps = _need(where + " spec", spec, "steps", int, positive=True)
    topk = spec.get("topk", 1)
    nodes = spec.get("num_draft_tokens", steps + 1)
    if not isinstance(topk, int) or topk < 1 or not isinstance(nodes, int) or nodes < 2:
        raise RuntimeUsageError(f"{where}: field 'spec.topk' must be >= 1 and 'spec.num_draft_tokens' >= 2, "
                                f"found {topk!r}, {nodes!r}")
    if topk == 1 and nodes != steps + 1:
        raise RuntimeUsageError(f"{where}: field 'spec.num_draft_tokens' of a chain (topk 1) is steps + 1 = {steps + 1}, "
                                f"found {nodes}")
    drafter = d.get("drafter") or {}
    draft = drafter.get("shape") if isinstance(drafter, dict) else None
    if draft not in shapes:
        raise RuntimeUsageError(f"{where}: field 'drafter.shape' {draft!r} names no entry of 'shapes'")
    algorithm = drafter.get("algorithm", "eagle3")
    algo = ALGORITHMS.get(algorithm) if isinstance(algorithm, str) else None
    if algo is None or not algo.needs_trained_draft or kinds.get(draft) != algorithm:
        raise RuntimeUsageError(f"{where}: field 'drafter.algorithm' must be eagle3 or dflash and match the kind of "
                                f"shape {draft!r} ({kinds.get(draft)!r}), found {algorithm!r}")
    if algo.drafts_block and topk != 1:
        raise RuntimeUsageError(f"{where}: field 'spec.topk' of a DFlash run must be 1 (one block a step), found {topk!r}")
    return steps, topk, nodes, draft, algorithm


def load_record(path: str | Path, gpus: dict) -> Record:
    """The record at `path` (YAML), checked field by field. `gpus`: the GPU table (pipeline.hardware.GPUS)."""
    import yaml

    p = Path(path)
    try:
        doc = yaml.safe_load(p.read_text())
    except OSError as e:
        raise RuntimeUsageError(f"{p}: cannot read it ({e.strerror or e})") from e
    except yaml.YAMLError as e:
        raise RuntimeUsageError(f"{p}: not valid YAML ({e})") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("runs"), list) or not doc["runs"]:
        raise RuntimeUsageError(f"{p}: expected a mapping with a non-empty 'runs' list (and 'shapes')")
    shapes = {k: _shape(str(p), k, v) for k, v in (doc.get("shapes") or {}).items()}
    kinds = {k: v.get("kind") for k, v in (doc.get("shapes") or {}).items()}
    runs = [_run(str(p), i, d, shapes, gpus, kinds) for i, d in enumerate(doc["runs"])]
    seen = set()
    for r in runs:
        if r.id in seen:
            raise RuntimeUsageError(f"{p}: run id '{r.id}' appears twice; ids name rows in the comparison")
        seen.add(r.id)
    return Record(str(p), shapes, runs, doc.get("sources") or {}, doc.get("excluded") or [])


# ------------------------------------------------------------------------------------------ pricing


@dataclass(frozen=True)
class Prediction:
    plain_step_s: float
    spec_step_s: float | None
    plain_tokens_per_s: float
    spec_tokens_per_s: float | None     # needs the run's acceptance length
    speedup: float | None


def deployment(run: Run, shapes: dict, gpus: dict, *, compute: float = 0.8, memory: float = 0.85,
               op_overhead_us: float = 2.0) -> cm.Deployment:
    """The run as tune prices a deployment (defaults: tune.efficiency's)."""
    gpu = gpus[run.gpu]
    m = cm.machine_from_gpu(gpu, compute_efficiency=compute, memory_efficiency=memory, op_overhead_us=op_overhead_us)
    wb = DTYPES[run.dtype]
    fmt = "fp8" if run.dtype == "fp8" else "bf16"
    prec = cm.Precision(fmt, wb, wb)
    return cm.Deployment(shapes[run.target], shapes[run.draft] if run.draft else None, run.algorithm, prec,
                         cm.Precision("bf16", 2.0, wb), m, run.tp, run.context)


def model_times(run: Run, dep: cm.Deployment) -> tuple[float, float | None]:
    """(plain step, speculative step) of the model alone, seconds."""
    plain = dep.target_time(run.batch, 1)
    if not run.steps:
        return plain, None
    if run.is_tree:
        return plain, dep.tree_time(run.batch, run.steps, run.topk, run.nodes)
    return plain, dep.spec_time(run.batch, run.steps)


def predict(run: Run, dep: cm.Deployment, ov: Overheads | None = None) -> Prediction:
    ov = ov or Overheads()
    plain, spec = model_times(run, dep)
    plain = ov.scale * plain + ov.step
    if spec is not None:
        spec = ov.spec_scale * spec + ov.step + ov.verify + run.steps * (ov.draft_pass + (ov.tree_pass if run.is_tree else 0))
    al = run.measured.get("al")
    spec_tps = run.batch * al / spec if (spec is not None and al) else None
    speedup = al * plain / spec if (spec is not None and al) else None
    return Prediction(plain, spec, run.batch / plain, spec_tps, speedup)


def errors(run: Run, pred: Prediction) -> dict:
    """Relative errors (predicted / published - 1) of what the run published: plain and speculative tokens/s,
    speedup; None where the run printed nothing to compare with."""
    m = run.measured

    def rel(p, q):
        return None if p is None or not q else p / q - 1

    return {"plain_tokens_per_s": rel(pred.plain_tokens_per_s, m.get("base_tokens_per_s")),
            "spec_tokens_per_s": rel(pred.spec_tokens_per_s, m.get("spec_tokens_per_s")),
            "speedup": rel(pred.speedup, run.published_speedup())}
