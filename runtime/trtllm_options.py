"""TensorRT-LLM LLM-API options for a speculative FP8 deployment: generate them for a version, check them.

Pure functions (no TensorRT-LLM import; it cannot be installed here). The field names each version accepts
come from `runtime/schemas/*.json`, extracted from TensorRT-LLM's `llm_args.py`; the semantics that differ
between versions come from `runtime/compat.py`. Everything the build stage writes goes through
`unknown_keys` (every key exists in the targeted version's schema) and `consistency_checks` (named checks
for the mistakes that make a deployment load but run badly: reference §2, §3, §8).

Draft-length schedules are carried internally as intervals `[(lo, hi, k)]`: batch sizes lo..hi (hi None =
unbounded) use k draft tokens. `schedule_to_intervals` / `intervals_to_schedule` translate to and from each
version's dict form, so a schedule tuned under one version's semantics is never misread by another.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path

from runtime import compat

Intervals = list[tuple[int, int | None, int]]


# ------------------------------------------------------------------------------------------ schemas


@lru_cache(maxsize=None)
def load_schema(name: str) -> dict:
    """A packaged schema: 'trtllm-1.2', 'trtllm-1.3' or 'triton-llmapi-model'."""
    return json.loads(resources.files("runtime").joinpath("schemas", f"{name}.json").read_text())


def _class_fields(schema: dict, cls: str) -> set[str]:
    c = schema["classes"][cls]
    names = set(c.get("all_field_names") or c["fields"])
    for f in c.get("fields", {}).values():
        names.update(f.get("aliases", []))
    return names


@lru_cache(maxsize=None)
def allowed_fields(version: str) -> dict[str, set[str]]:
    """Field names per config class for `version`: 'top', 'kv_cache_config', 'cuda_graph_config',
    'decoding_types' and one entry per speculative decoding_type."""
    rel = compat.release(version)
    spec = load_schema(rel.schema)
    base = load_schema("trtllm-1.2")  # 1.3's extraction covers speculative classes only (see its "note")
    out = {
        "top": _class_fields(base, "TorchLlmArgs"),
        "kv_cache_config": _class_fields(base, "KvCacheConfig"),
        "cuda_graph_config": _class_fields(base, "CudaGraphConfig"),
        "decoding_types": set(spec["decoding_types"]),
    }
    aliases = {a for f in spec["classes"]["DecodingBaseConfig"]["fields"].values() for a in f.get("aliases", [])}
    for dtype, cls in spec["decoding_types"].items():
        if cls in spec["classes"]:
            out[f"speculative:{dtype}"] = _class_fields(spec, cls) | aliases | {"decoding_type"}
    return out


TRITON_CONFIG_KEYS = {"max_batch_size", "decoupled", "cancellation_check_period_ms"}


def unknown_keys(options: dict, version: str, *, model_yaml: bool = False) -> list[str]:
    """Dotted paths of keys `version` does not know (empty = every key exists in its schema).
    `model_yaml`: the body of Triton's model.yaml, which adds `triton_config`."""
    f = allowed_fields(version)
    bad: list[str] = []
    for k, v in options.items():
        if model_yaml and k == "triton_config":
            bad += [f"triton_config.{t}" for t in v if t not in TRITON_CONFIG_KEYS]
            continue
        if k not in f["top"]:
            bad.append(k)
            continue
        if k in ("kv_cache_config", "cuda_graph_config") and isinstance(v, dict):
            bad += [f"{k}.{t}" for t in v if t not in f[k]]
        if k == "speculative_config" and isinstance(v, dict):
            dtype = v.get("decoding_type")
            if dtype not in f["decoding_types"] or f"speculative:{dtype}" not in f:
                bad.append(f"speculative_config.decoding_type={dtype}")
            else:
                bad += [f"speculative_config.{t}" for t in v if t not in f[f"speculative:{dtype}"]]
    return bad


# ------------------------------------------------------------------------------------------ schedules


def schedule_to_intervals(schedule: dict, semantics: compat.Semantics) -> Intervals:
    keys = sorted((int(k), int(v)) for k, v in schedule.items())
    out: Intervals = []
    if semantics == "lower_bound":   # {1: 4, 4: 2, 8: 0}: batch >= key uses value
        for i, (lo, k) in enumerate(keys):
            hi = keys[i + 1][0] - 1 if i + 1 < len(keys) else None
            out.append((lo, hi, k))
    else:                            # {3: 4, 7: 2}: batch <= key uses value, above the last key: 0
        lo = 1
        for hi, k in keys:
            out.append((lo, hi, k))
            lo = hi + 1
        out.append((lo, None, 0))
    return merge_intervals(out)


def intervals_to_schedule(intervals: Intervals, semantics: compat.Semantics, max_batch_size: int) -> dict[int, int]:
    """The version's dict form. Batch sizes above max_batch_size never occur, so an unbounded last interval
    becomes max_batch_size for upper-bound semantics."""
    iv = merge_intervals([(lo, hi, k) for lo, hi, k in intervals if lo <= max_batch_size])
    if semantics == "lower_bound":
        return {lo: k for lo, _, k in iv}
    out: dict[int, int] = {}
    for lo, hi, k in iv:
        if k > 0:
            out[min(hi, max_batch_size) if hi is not None else max_batch_size] = k
    return out


def merge_intervals(iv: Intervals) -> Intervals:
    out: Intervals = []
    for lo, hi, k in sorted(iv):
        if out and out[-1][2] == k and out[-1][1] is not None and out[-1][1] + 1 == lo:
            out[-1] = (out[-1][0], hi, k)
        else:
            out.append((lo, hi, k))
    return out


def cap_intervals(intervals: Intervals, max_concurrency: int | None) -> Intervals:
    """Fold max_concurrency (speculation off above it) into the schedule."""
    if max_concurrency is None:
        return intervals
    out: Intervals = []
    for lo, hi, k in intervals:
        if lo > max_concurrency:
            out.append((lo, hi, 0))
        elif hi is None or hi > max_concurrency:
            out += [(lo, max_concurrency, k), (max_concurrency + 1, hi, 0)]
        else:
            out.append((lo, hi, k))
    return merge_intervals(out)


def schedule_problems(schedule: dict, max_draft_len: int, version: str) -> list[str]:
    """The version's own validation rules for draft_len_schedule (reference §2, schemas `rules`)."""
    rel = compat.release(version)
    keys = sorted(int(k) for k in schedule)
    probs = []
    if not keys:
        return ["draft_len_schedule is empty"]
    if keys[0] < 1 or any(int(v) < 0 for v in schedule.values()):
        probs.append("keys must be >= 1 and values >= 0")
    if any(int(v) > max_draft_len for v in schedule.values()):
        probs.append(f"every draft length must be <= max_draft_len {max_draft_len}")
    first = int(schedule[keys[0]] if keys[0] in schedule else schedule[str(keys[0])])
    if rel.schedule_semantics == "lower_bound" and (keys[0] != 1 or first != max_draft_len):
        probs.append(f"TensorRT-LLM {version} needs key 1 with value max_draft_len ({max_draft_len})")
    if rel.schedule_semantics == "upper_bound" and first != max_draft_len:
        probs.append(f"TensorRT-LLM {version} needs the smallest key's value to equal max_draft_len ({max_draft_len})")
    return probs


# ------------------------------------------------------------------------------------------ options


def default_layers_to_capture(num_layers: int) -> set[int]:
    """TensorRT-LLM's default EAGLE-3 capture set {1, L//2-1, L-4} (0-based), as ModelOpt also uses."""
    return {1, num_layers // 2 - 1, num_layers - 4}


@dataclass
class DeploymentSpec:
    version: str
    algorithm: str                      # eagle3 | dflash
    draft_dir: str
    max_draft_len: int
    num_target_layers: int
    aux_layer_ids: list[int] | None     # EAGLE-3 layers the draft was trained on
    max_batch_size: int
    max_num_tokens: int
    max_seq_len: int
    schedule: Intervals | None = None   # speculation per batch size (None: max_draft_len at every size)
    max_concurrency: int | None = None
    cuda_graph_batch_sizes: list[int] | None = None
    cuda_graph_padding: bool = True
    kv_cache: dict = field(default_factory=lambda: {"free_gpu_memory_fraction": 0.85, "enable_block_reuse": True})
    eagle3_one_model: bool = True
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    acceptance_window: int | None = None         # guard: switch speculation off when acceptance collapses
    min_acceptance_rate: float | None = None


def llm_api_options(spec: DeploymentSpec) -> dict:
    """The extra_llm_api_options dict (no `model`/`backend`: those are command-line arguments of trtllm-serve
    and trtllm-bench, and are added to Triton's model.yaml by the export)."""
    rel = compat.release(spec.version)
    sc: dict = {"decoding_type": rel.decoding_types.get(spec.algorithm, spec.algorithm),
                "max_draft_len": spec.max_draft_len, "speculative_model": spec.draft_dir}
    if spec.algorithm == "eagle3":
        if rel.emits_eagle3_one_model:
            sc["eagle3_one_model"] = spec.eagle3_one_model
        if spec.aux_layer_ids is not None and set(spec.aux_layer_ids) != default_layers_to_capture(spec.num_target_layers):
            # 1.2 does not read eagle_aux_hidden_state_layer_ids from the draft config (reference §3)
            sc["eagle3_layers_to_capture"] = sorted(spec.aux_layer_ids)
    if spec.schedule is not None or spec.max_concurrency is not None:
        # One step function (draft length per batch size), written the way the version reads it. A constant
        # draft length with a cut-off is just max_concurrency; anything else is a schedule (in 1.3 the
        # schedule must carry the cut-off itself: the two fields are mutually exclusive there).
        iv = cap_intervals(spec.schedule or [(1, None, spec.max_draft_len)], spec.max_concurrency)
        iv = merge_intervals([(lo, hi, k) for lo, hi, k in iv if lo <= spec.max_batch_size])
        on = [x for x in iv if x[2] > 0]
        if len(on) == 1 and on[0][0] == 1 and on[0][2] == spec.max_draft_len:
            hi = on[0][1]
            if hi is not None and hi < spec.max_batch_size:
                sc["max_concurrency"] = hi
        else:
            sc["draft_len_schedule"] = intervals_to_schedule(iv, rel.schedule_semantics, spec.max_batch_size)
    if spec.min_acceptance_rate is not None and spec.acceptance_window:
        sc[rel.acceptance_window_key] = spec.acceptance_window
        sc[rel.acceptance_threshold_key] = (spec.min_acceptance_rate if rel.acceptance_threshold_kind == "rate"
                                            # 1.2 thresholds a length: AL = 1 + rate * draft length
                                            else round(1.0 + spec.min_acceptance_rate * spec.max_draft_len, 4))
    opts: dict = {
        "tensor_parallel_size": spec.tensor_parallel_size,
        "pipeline_parallel_size": spec.pipeline_parallel_size,
        "max_batch_size": spec.max_batch_size,
        "max_num_tokens": spec.max_num_tokens,
        "max_seq_len": spec.max_seq_len,
        "kv_cache_config": dict(spec.kv_cache),
    }
    if spec.cuda_graph_batch_sizes:
        # batch_sizes only: with max_batch_size too, 1.2 requires batch_sizes to equal its generated list
        opts["cuda_graph_config"] = {"enable_padding": spec.cuda_graph_padding,
                                     "batch_sizes": sorted(set(spec.cuda_graph_batch_sizes))}
    if spec.algorithm == "eagle3" and not spec.eagle3_one_model:
        opts["disable_overlap_scheduler"] = True   # two-model EAGLE-3 needs it (reference §2)
    opts["enable_iter_perf_stats"] = True          # llm.get_stats() -> specDecodingStats
    opts["speculative_config"] = sc
    return opts


def dump_yaml(doc: dict) -> str:
    """Block-style mappings, flow-style lists and schedules: readable, and still plain YAML."""
    import yaml

    class _Dumper(yaml.SafeDumper):
        pass

    def _dict(d, data):
        flow = bool(data) and all(isinstance(k, int) for k in data)
        return d.represent_mapping("tag:yaml.org,2002:map", data.items(), flow_style=flow)

    _Dumper.add_representer(dict, _dict)
    _Dumper.add_representer(list, lambda d, data: d.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True))
    return yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=120)


# ------------------------------------------------------------------------------------------ checks


@dataclass
class Check:
    name: str
    ok: bool
    message: str


def safetensors_tensors(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape from a safetensors header (no torch, no weight bytes read)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}


def _draft_tensors(draft_dir: Path) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for f in sorted(Path(draft_dir).glob("*.safetensors")):
        out.update(safetensors_tensors(f))
    return out


def _draft_positions(dcfg: dict) -> int | None:
    mpe = dcfg.get("max_position_embeddings")
    rs = dcfg.get("rope_scaling") or {}
    if rs.get("factor") and rs.get("original_max_position_embeddings"):
        return max(mpe or 0, int(rs["factor"] * rs["original_max_position_embeddings"]))
    return mpe


def consistency_checks(options: dict, *, version: str, algorithm: str, target_dir: Path, draft_dir: Path,
                       target_vocab_size: int | None = None) -> list[Check]:
    """Named checks of a deployment (options + the checkpoints it points at). All run; callers decide."""
    sc = options.get("speculative_config") or {}
    checks: list[Check] = []

    def add(name: str, ok: bool, msg: str) -> None:
        checks.append(Check(name, bool(ok), msg))

    mbs, mnt = options.get("max_batch_size"), options.get("max_num_tokens")
    k_total = sc.get("max_total_draft_tokens") or sc.get("max_draft_len") or 0
    need = (mbs or 0) * (1 + k_total)
    add("token_budget", mnt is not None and mbs is not None and mnt >= need,
        f"max_num_tokens {mnt} must cover max_batch_size {mbs} x (1 + max_total_draft_tokens {k_total}) = {need} "
        "(every generation request needs 1 + draft tokens per step)")

    cg = options.get("cuda_graph_config") or {}
    sizes = list(cg.get("batch_sizes") or []) + ([cg["max_batch_size"]] if cg.get("max_batch_size") else [])
    over = [s for s in sizes if mbs is not None and s > mbs]
    add("cuda_graph_batch_sizes", not over,
        f"CUDA-graph batch sizes {sorted(sizes)} must not exceed max_batch_size {mbs}"
        + (f"; too large: {over}" if over else ""))

    qc = Path(target_dir) / "hf_quant_config.json"
    algo = None
    if qc.exists():
        try:
            algo = (json.loads(qc.read_text()).get("quantization") or {}).get("quant_algo")
        except ValueError:
            algo = "unreadable"
    add("fp8_target_quant_config", algo == "FP8",
        f"{qc} must exist with quantization.quant_algo FP8 (found: {algo if qc.exists() else 'no file'}); "
        "without it TensorRT-LLM loads the target unquantized")

    if algorithm == "eagle3":
        try:
            dcfg = json.loads((Path(draft_dir) / "config.json").read_text())
        except (OSError, ValueError) as e:
            dcfg = {}
            add("draft_vocab", False, f"draft config unreadable: {e}")
        else:
            tensors = _draft_tensors(Path(draft_dir))
            dvs, vs = dcfg.get("draft_vocab_size"), dcfg.get("vocab_size") or target_vocab_size
            d2t = tensors.get("d2t")
            lm = tensors.get("lm_head.weight")
            if dvs is None:
                ok = d2t is None
                msg = ("draft config has no draft_vocab_size (TensorRT-LLM assumes the full vocab)"
                       + ("" if ok else f" but ships a d2t map of {d2t[0]} entries"))
            elif vs is not None and dvs != vs:
                ok = d2t is not None and d2t[0] == dvs and (lm is None or lm[0] == dvs)
                msg = (f"draft_vocab_size {dvs} != vocab_size {vs} needs a d2t tensor of {dvs} entries "
                       f"(found {'none' if d2t is None else d2t[0]}) and an lm_head of {dvs} rows "
                       f"(found {lm[0] if lm else 'none'}); without it acceptance collapses silently")
            else:
                ok = d2t is None or d2t[0] == dvs
                msg = f"draft_vocab_size {dvs} == vocab_size {vs}" + ("" if ok else f", but d2t has {d2t[0]} entries")
            add("draft_vocab", ok, msg)
    else:
        add("draft_vocab", True, f"not applicable to {algorithm} (the draft reuses the target's vocabulary)")
    try:
        dcfg = json.loads((Path(draft_dir) / "config.json").read_text())
    except (OSError, ValueError):
        dcfg = {}
    if algorithm == "dflash":
        bs = dcfg.get("block_size")
        k = sc.get("max_draft_len") or 0
        add("dflash_block_size", bs is not None and k <= bs - 1,
            f"DFlash max_draft_len {k} must be <= block_size - 1 ({bs - 1 if bs else 'block_size missing'})")
    positions = _draft_positions(dcfg)
    msl = options.get("max_seq_len")
    add("draft_positions", positions is None or msl is None or positions >= msl,
        f"the draft covers {positions} positions, max_seq_len is {msl}: a draft whose RoPE range is shorter than "
        "the serving context clamps positions and acceptance collapses past it")

    one_model = sc.get("eagle3_one_model", True)
    add("two_model_overlap_scheduler", algorithm != "eagle3" or one_model or options.get("disable_overlap_scheduler") is True,
        "two-model EAGLE-3 (eagle3_one_model: false) needs disable_overlap_scheduler: true")

    pp = options.get("pipeline_parallel_size", 1)
    add("no_pipeline_parallel", not sc or pp == 1,
        f"speculative decoding is incompatible with pipeline parallelism (pipeline_parallel_size {pp})")

    if "draft_len_schedule" in sc:
        probs = schedule_problems(sc["draft_len_schedule"], sc.get("max_draft_len") or 0, version)
        add("draft_len_schedule", not probs, "; ".join(probs) or f"valid for TensorRT-LLM {version}")
    if compat.release(version).schedule_with_max_concurrency is False:
        add("schedule_xor_concurrency", not ("draft_len_schedule" in sc and "max_concurrency" in sc),
            f"TensorRT-LLM {version} rejects max_concurrency together with draft_len_schedule")

    bad = unknown_keys(options, version)
    add("schema_keys", not bad, f"keys unknown to TensorRT-LLM {version}: {bad}" if bad else f"every key exists in TensorRT-LLM {version}")
    return checks
