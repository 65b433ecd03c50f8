"""Named consistency checks of a TensorRT-LLM deployment: the LLM-API options against the checkpoints they
point at and the version that reads them (the mistakes that make a deployment load but run badly, or not load).
Pure functions: they read config.json, hf_quant_config.json and safetensors headers, never TensorRT-LLM."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from runtime import hf_config
from runtime.algorithms import eagle3
from runtime.algorithms.export import DraftExportError, read_export
from runtime.algorithms.registry import get as get_algorithm
from runtime.algorithms.schedule import DraftSchedule
from runtime.quant import hf_quant_config
from runtime.trtllm import compat, draft_schedule
from runtime.trtllm.draft_weights import safetensors_dtypes, safetensors_tensors
from runtime.trtllm.schema import unknown_keys


@dataclass
class Check:
    name: str
    ok: bool
    message: str


def _draft_tensors(draft_dir: Path) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for f in sorted(Path(draft_dir).glob("*.safetensors")):
        out.update(safetensors_tensors(f))
    return out


def draft_positions(dcfg: dict) -> int | None:
    """The positions a draft's config.json covers (max_position_embeddings, or its scaled RoPE range)."""
    mpe = dcfg.get("max_position_embeddings")
    rs = dcfg.get("rope_scaling") or {}
    if rs.get("factor") and rs.get("original_max_position_embeddings"):
        return max(mpe or 0, int(rs["factor"] * rs["original_max_position_embeddings"]))
    return mpe


def _read_json(path: Path) -> tuple[dict, str | None]:
    try:
        return json.loads(Path(path).read_text()), None
    except (OSError, ValueError) as e:
        return {}, f"{path}: {e}"


def _quant_algo(d: Path) -> tuple[str | None, bool]:
    try:
        block = hf_quant_config.read(d)
    except hf_quant_config.HFQuantConfigError:
        return "unreadable", True
    return (None, False) if block is None else (block.get("quant_algo"), True)


@dataclass(frozen=True)
class Expected:
    """What a deployment must agree with beyond its own files (None: not checked): the target's vocabulary, hidden
    size and layer count, the layers the EAGLE-3 draft was trained on (draft.json), the tuned draft length per batch
    size the options must reproduce, and the RoPE theta each model was built/trained with."""

    target_vocab_size: int | None = None
    target_hidden_size: int | None = None
    num_target_layers: int | None = None
    capture_layers: list[int] | None = None
    schedule: DraftSchedule | None = None
    target_rope_theta: float | None = None
    draft_rope_theta: float | None = None


@dataclass(frozen=True)
class _Deployment:
    """One speculative deployment under check: its options and speculative_config, the release and mode that read
    them, the draft checkpoint and what it must agree with."""

    options: dict
    sc: dict
    rel: compat.Release
    version: str
    mode: compat.Mode
    algorithm: str
    draft_dir: Path
    expected: Expected

    @property
    def algo(self):
        return get_algorithm(self.algorithm)


def consistency_checks(options: dict, *, version: str, algorithm: str, target_dir: Path, draft_dir: Path | None,
                       expected: Expected = Expected()) -> list[Check]:
    """Named checks of a deployment (options + the checkpoints it points at) against `expected`. All run; callers
    decide."""
    rel = compat.release(version)
    sc = options.get("speculative_config") or {}
    mode = rel.mode(algorithm, sc.get("eagle3_one_model", True))
    mbs, mnt = options.get("max_batch_size"), options.get("max_num_tokens")
    checks: list[Check] = []

    def add(name: str, ok: bool, msg: str) -> None:
        checks.append(Check(name, bool(ok), msg))

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

    algo, present = _quant_algo(target_dir)
    add("target_quant_config", algo in rel.quant_algos,
        f"{Path(target_dir) / 'hf_quant_config.json'} must exist with a quantization.quant_algo TensorRT-LLM {version} "
        f"serves ({', '.join(sorted(rel.quant_algos))}); found: {algo if present else 'no file'} "
        "(without the file TensorRT-LLM loads the target unquantized)")

    tcfg, _ = _read_json(Path(target_dir) / "config.json")
    rp = hf_config.problems(tcfg, rel.hf_rope_form, expected_theta=expected.target_rope_theta)
    form = 'transformers 4.57: rope_theta/rope_scaling' if rel.hf_rope_form == 'legacy' else 'transformers 5: rope_parameters'
    add("target_rope", not rp, f"target config.json, read as TensorRT-LLM {version} reads it ({form}): "
        + ("; ".join(rp) if rp else f"theta {hf_config.read(tcfg).theta:g}" if hf_config.read(tcfg) else ""))

    if not sc:
        add("speculation", True, "no speculative_config: tune predicted no speedup at any batch size, the target "
                                 "is deployed alone (draft checks not applicable)")
        add("two_model_overlap_scheduler", True, "not applicable without speculation")
        add("no_pipeline_parallel", True, "not applicable without speculation")
    else:
        _draft_checks(add, _Deployment(options, sc, rel, version, mode, algorithm, Path(draft_dir), expected))

    add("long_prompts", *long_prompt_check(options))

    bad = unknown_keys(options, version)
    add("schema_keys", not bad, f"keys unknown to TensorRT-LLM {version}: "
                                f"{bad}" if bad else f"every key exists in TensorRT-LLM {version}")
    return checks


def prompt_rejection(options: dict, prompt_len: int, query_len: int = 0, cp_size: int = 1,
                     is_gen_only: bool = False) -> str | None:
    """Why TensorRT-LLM's PyTorch backend refuses a request of `prompt_len` prompt tokens under `options` before it is
    queued, or None: `BaseLLM._check_arguments` in tensorrt_llm/llmapi/llm.py (compat.SOURCES prompt_vs_max_num_tokens).
    Without `enable_chunked_prefill` a prompt (divided by the context-parallel size, plus the query) longer than
    `max_num_tokens` is rejected, because its prefill must fit one iteration's token budget; generation-only
    (disaggregated) requests are not checked. The message is upstream's, with the fix appended."""
    mnt = options.get("max_num_tokens", TRTLLM_DEFAULT_MAX_NUM_TOKENS)
    if options.get("enable_chunked_prefill") or is_gen_only or not mnt:
        return None
    if prompt_len / cp_size + query_len > mnt:
        return (f"The sum of prompt length ({prompt_len / cp_size}), query length ({query_len}) should not exceed "
                f"max_num_tokens ({mnt})")
    return None


# TorchLlmArgs.max_num_tokens default (runtime/trtllm/schemas/trtllm-1.2.json), used where the options omit it
TRTLLM_DEFAULT_MAX_NUM_TOKENS = 8192


def longest_prompt(options: dict) -> int | None:
    """The longest prompt a deployment is meant to serve: `max_seq_len` less one output token (None: unset)."""
    msl = options.get("max_seq_len")
    return None if not msl else int(msl) - 1


def long_prompt_check(options: dict) -> tuple[bool, str]:
    """Every prompt up to max_seq_len - 1 tokens passes `prompt_rejection` (the PyTorch backend's admission rule)."""
    n = longest_prompt(options)
    if n is None:
        return True, "max_seq_len unset: TensorRT-LLM derives it from the model (not checked)"
    why = prompt_rejection(options, n)
    if why is None:
        how = ("enable_chunked_prefill: true (the prefill is split across iterations)" if options.get("enable_chunked_prefill")
               else f"max_num_tokens {options.get('max_num_tokens')} covers it")
        return True, f"a prompt of max_seq_len - 1 = {n} tokens is accepted: {how}"
    return False, (f"a prompt of {n} tokens (max_seq_len {options['max_seq_len']} - 1) would be refused by the PyTorch "
                   f"backend: '{why}'. Set build.chunked_prefill: auto (writes enable_chunked_prefill: true), or cap "
                   f"build.max_seq_len at max_num_tokens {options.get('max_num_tokens')} (a deliberate prompt limit)")


def _draft_checks(add, d: _Deployment) -> None:
    options, sc, rel, version, mode, algorithm, draft_dir = d.options, d.sc, d.rel, d.version, d.mode, d.algorithm, d.draft_dir
    dcfg, err = _read_json(draft_dir / "config.json")
    tensors = _draft_tensors(draft_dir) if not err else {}
    k = sc.get("max_draft_len") or 0
    algo = get_algorithm(algorithm)
    if algo.trtllm_layers_to_capture:
        _eagle3_checks(add, d, dcfg, err, tensors)
    else:
        add("draft_vocab", True, f"not applicable to {algo.title} (the draft reuses the target's vocabulary)")
    if algo.fp8_draft:
        add("draft_fc_precision", *eagle3_fc_precision(draft_dir, rel, version))
    if algo.drafts_block:
        _block_size_check(add, algo, dcfg, k)
    _draft_file_checks(add, options, rel, version, draft_dir, dcfg, d.expected.draft_rope_theta)
    _parallelism_checks(add, options, sc, algorithm)
    _schedule_checks(add, options, sc, rel, version, mode, k, d.expected.schedule)
    _acceptance_guard_check(add, sc, rel, version, mode, k)


def _eagle3_checks(add, d: _Deployment, dcfg: dict, err: str | None, tensors: dict) -> None:
    sc, e = d.sc, d.expected
    if err:
        add("draft_vocab", False, f"draft config unreadable: {err}")
    else:
        add("draft_vocab", *_draft_vocab(d.draft_dir, {"vocab_size": e.target_vocab_size, **dcfg}))
    # the layers TensorRT-LLM captures = the ones the draft was trained on, and fc is sized for them
    written = sc.get("eagle3_layers_to_capture")
    trained = e.capture_layers if e.capture_layers is not None else \
        d.algo.capture_layers(dcfg)
    probs = _capture_layer_problems(written, trained, e.num_target_layers)
    add("eagle3_capture_layers", not probs,
        "; ".join(probs) or f"TensorRT-LLM captures target layers {sorted(written)} (the draft's)")
    _eagle3_fc_check(add, d.draft_dir, {"vocab_size": e.target_vocab_size, **dcfg}, tensors)
    if d.algo.trtllm_renamed_weights:
        _draft_weight_names_check(add, tensors, d.rel, d.version)


def _draft_vocab(draft_dir: Path, dcfg: dict) -> tuple[bool, str]:
    """The draft's vocabulary and d2t as runtime/algorithms/eagle3.py defines them (`vocab_problems`), with a missing
    draft_vocab_size read as the full vocabulary, as TensorRT-LLM's `_ensure_draft_vocab_size` does."""
    cfg = dict(dcfg)
    if cfg.get("draft_vocab_size") is None:
        cfg["draft_vocab_size"] = cfg.get("vocab_size")
    if cfg.get("vocab_size") is None:
        return False, f"{draft_dir}/config.json has no vocab_size"
    probs = eagle3.vocab_problems(read_export(draft_dir, cfg))
    dvs, vs = cfg["draft_vocab_size"], cfg["vocab_size"]
    return not probs, "; ".join(p.message for p in probs) or (
        f"draft_vocab_size {dvs} {'==' if dvs == vs else '<'} vocab_size {vs}" + ("" if dvs == vs else ", d2t valid"))


def _capture_layer_problems(written, trained, num_target_layers: int | None) -> list[str]:
    """What is wrong with the written eagle3_layers_to_capture against the layers the draft was trained on."""
    probs = []
    if written is None:
        probs.append("eagle3_layers_to_capture is not written: TensorRT-LLM would capture its default 3 layers "
                     "(1, L//2-1, L-4), and raises 'Not enough hidden layers for default EAGLE3 capture' for L <= 5")
    elif trained is None:
        probs.append("the draft's capture layers are unknown (draft.json aux_layer_ids / eagle_config)")
    else:
        want = sorted(set(int(i) for i in trained))
        if sorted(written) != want:
            probs.append(f"eagle3_layers_to_capture {sorted(written)} != the draft's capture layers {want}")
        if len(want) != len(trained):
            probs.append(f"the draft's capture layers {list(trained)} repeat a layer: TensorRT-LLM captures a set "
                         f"({want}) and would feed fc {len(want)} hidden states")
        if len(want) < 2:
            probs.append(f"{len(want)} capture layer: TensorRT-LLM builds the draft's fc only for 2 or more")
        if num_target_layers and any(i < 0 or i >= num_target_layers for i in want):
            probs.append(f"capture layers {want} must lie in 0..{num_target_layers - 1}")
    return probs


def _eagle3_fc_check(add, draft_dir: Path, dcfg: dict, tensors: dict) -> None:
    """fc's width against the capture layers, in the words of the algorithm's own check (runtime/algorithms/eagle3.py
    `check_export`, rule fc_shape). TensorRT-LLM sizes fc as hidden x the number of layers it captures
    (modeling_speculative.py Eagle3DraftModel); those are the written eagle3_layers_to_capture, which must equal the
    layers config.json declares (eagle3_capture_layers above), so the declared ones are the ones to check against."""
    fc = tensors.get("fc.weight")
    if fc is None:
        add("eagle3_fc_shape", False, "the draft has no fc.weight")
        return
    cfg = {**dcfg, "draft_vocab_size": dcfg.get("draft_vocab_size") or dcfg.get("vocab_size")}
    try:
        probs = [p for p in eagle3.EAGLE3.check_export(read_export(draft_dir, cfg)) if p.check in ("fc_shape", "config_keys")]
    except DraftExportError as e:
        probs = [e]
    ids = eagle3.capture_layer_ids(cfg) or []
    add("eagle3_fc_shape", not probs, "; ".join(getattr(p, "message", str(p)) for p in probs) or
        f"fc.weight {fc} = {len(ids)} capture layers x {cfg.get('hidden_size')} hidden (runtime/algorithms/eagle3.py "
        "check_export; TensorRT-LLM sizes fc as hidden x number of capture layers)")


def eagle3_fc_precision(draft_dir: Path, rel: compat.Release, version: str) -> tuple[bool, str]:
    """An FP8 `fc.weight` only where the version's loader builds fc with the draft's quant config: the 1.2 one casts
    it to BF16 without its scale, silently (compat.SOURCES eagle3_fc_quant)."""
    dtypes: dict[str, str] = {}
    for f in sorted(Path(draft_dir).glob("*.safetensors")):
        dtypes.update(safetensors_dtypes(f))
    dt = dtypes.get("fc.weight")
    if dt is None or not dt.startswith("F8") or rel.eagle3_fc_fp8:
        return True, f"fc.weight is {dt or 'absent'}: TensorRT-LLM {version} reads it as stored"
    return False, (f"fc.weight is {dt}, but TensorRT-LLM {version}'s Eagle3DraftModel builds fc without a quant config: "
                   "the FP8 codes would be cast to BF16 without fc.weight_scale, silently (a wrong draft). Quantize "
                   "the draft with quantize.draft_fc: bf16 (or quantize.draft: none), or deploy on the 1.3 line")


def _draft_weight_names_check(add, tensors: dict, rel: compat.Release, version: str) -> None:
    layer_names = [t for t in tensors if t.startswith(("layers.", "midlayer"))]
    stale = [t for t in layer_names if t.startswith("layers.")] if rel.eagle3_draft_layer_prefix == "midlayer" else []
    add("draft_weight_names", layer_names and not stale,
        (f"{len(stale)} tensor(s) named layers.<i>.* (e.g. {stale[0]}): TensorRT-LLM {version}'s EAGLE-3 module is "
         "midlayer and its loader does not remap them, so they would be skipped silently" if stale else
         "the draft has no decoder-layer tensors" if not layer_names else
         f"decoder-layer tensors named as TensorRT-LLM {version} reads them "
         "(" + ('midlayer.*' if rel.eagle3_draft_layer_prefix == 'midlayer'
                else 'layers.<i>.* remapped by the loader, or midlayer.*') + ")"))


def _block_size_check(add, algo, dcfg: dict, k: int) -> None:
    bs = dcfg.get("block_size")
    cap = algo.draft_len_cap(bs) if isinstance(bs, int) and bs >= 2 else None
    add("dflash_block_size", cap is not None and k <= cap,
        f"DFlash max_draft_len {k} must be <= block_size - 1 ({cap if cap is not None else 'block_size missing'})")


def _draft_file_checks(add, options: dict, rel: compat.Release, version: str, draft_dir: Path, dcfg: dict,
                       draft_rope_theta: float | None) -> None:
    """The draft checkpoint as TensorRT-LLM reads it: its quantization, its RoPE, the positions it covers."""
    algo, present = _quant_algo(draft_dir)
    if present:
        add("draft_quant_config", algo in rel.quant_algos,
            f"draft hf_quant_config.json quant_algo {algo}: TensorRT-LLM {version} serves {', '.join(sorted(rel.quant_algos))}")

    rp = hf_config.problems(dcfg, rel.hf_rope_form, expected_theta=draft_rope_theta)
    add("draft_rope", not rp, "draft config.json: " + ("; ".join(rp) if rp else "RoPE stated as TensorRT-LLM "
                                                        f"{version} reads it"))

    positions = draft_positions(dcfg)
    msl = options.get("max_seq_len")
    add("draft_positions", positions is None or msl is None or positions >= msl,
        f"the draft covers {positions} positions, max_seq_len is {msl}: a draft whose RoPE range is shorter than "
        "the serving context clamps positions and acceptance collapses past it")


def _parallelism_checks(add, options: dict, sc: dict, algorithm: str) -> None:
    one_model = sc.get("eagle3_one_model", True)
    two_model = get_algorithm(algorithm).trtllm_two_model and not one_model
    add("two_model_overlap_scheduler", not two_model or options.get("disable_overlap_scheduler") is True,
        "two-model EAGLE-3 (eagle3_one_model: false) needs disable_overlap_scheduler: true")

    pp = options.get("pipeline_parallel_size", 1)
    add("no_pipeline_parallel", pp == 1,
        f"speculative decoding is incompatible with pipeline parallelism (pipeline_parallel_size {pp})")


def _schedule_checks(add, options: dict, sc: dict, rel: compat.Release, version: str, mode: compat.Mode, k: int,
                     schedule: DraftSchedule | None) -> None:
    """The draft length per batch size the options make `version` run: valid, never an unsafe 0, as tuned."""
    if "draft_len_schedule" in sc:
        probs = draft_schedule.schedule_problems(sc["draft_len_schedule"], k, rel)
        add("draft_len_schedule", not probs, "; ".join(probs) or f"valid for TensorRT-LLM {version}")
    if rel.schedule_with_max_concurrency is False:
        add("schedule_xor_concurrency", not ("draft_len_schedule" in sc and "max_concurrency" in sc),
            f"TensorRT-LLM {version} rejects max_concurrency together with draft_len_schedule")
    mbs = options.get("max_batch_size") or 1
    runs = draft_schedule.decode(sc, rel, mode, mbs)
    zero = [r for r in runs.bounded(mbs) if r[2] == 0]
    add("zero_draft_len", not zero or mode in rel.zero_draft_len_ok,
        f"TensorRT-LLM {version} ({mode.replace('_', '-')}) would run batch sizes {zero[0][0] if zero else ''}"
        f"{'-' + str(zero[0][1]) if zero else ''} with 0 draft tokens, which corrupts one-engine drafter state "
        "(PR #16888)" if zero else "no batch size resolves to 0 draft tokens where that is unsafe")
    if schedule is not None:
        want = DraftSchedule.from_json(schedule.to_json(mbs))
        add("schedule_as_tuned", runs == want,
            f"TensorRT-LLM {version} ({mode.replace('_', '-')}) would use {runs.describe(mbs)}; tuned: {want.describe(mbs)}")


def _acceptance_guard_check(add, sc: dict, rel: compat.Release, version: str, mode: compat.Mode, k: int) -> None:
    if rel.acceptance_window_key in sc or rel.acceptance_threshold_key in sc:   # other spellings: schema_keys
        th = sc.get(rel.acceptance_threshold_key)
        hi = 1.0 if rel.acceptance_threshold_kind == "rate" else float(k)
        ok = mode in rel.acceptance_guard_modes and th is not None and 0 <= float(th) <= hi
        add("acceptance_guard", ok,
            f"{rel.acceptance_threshold_key} {th} must be in [0, {hi:g}] "
            f"({'a rate accepted/drafted' if rel.acceptance_threshold_kind == 'rate' else 'accepted draft tokens per step'}) "
            f"and the guard must be one {version} evaluates in {mode.replace('_', '-')} mode")
