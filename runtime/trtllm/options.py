"""TensorRT-LLM LLM-API options for a speculative FP8 deployment, in the targeted version's terms.

Pure functions (no TensorRT-LLM import; it cannot be installed here). The behaviour that differs between versions
and modes comes from `runtime/trtllm/compat.py` (with the upstream source of each fact); the draft-length schedule
(`runtime/algorithms/schedule.py`) and its encodings from `runtime/trtllm/draft_schedule.py`. What the build stage
writes is then checked:
`runtime/trtllm/schema.py` (every key exists in the targeted version's field list) and `runtime/trtllm/checks.py`
(named checks against the checkpoints the options point at).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from runtime.algorithms.registry import get as get_algorithm
from runtime.algorithms.schedule import DraftSchedule
from runtime.trtllm import compat, draft_schedule


@dataclass
class DeploymentSpec:
    version: str
    algorithm: str                      # eagle3 | dflash
    draft_dir: str
    schedule: DraftSchedule             # draft length per batch size (tune's, for this version and mode)
    capture_layers: list[int] | None    # EAGLE-3: target layers whose hidden states the draft was trained on
    max_batch_size: int
    max_num_tokens: int
    max_seq_len: int
    cuda_graph_batch_sizes: list[int] | None = None
    cuda_graph_padding: bool = True
    kv_cache: dict = field(default_factory=lambda: {"free_gpu_memory_fraction": 0.85, "enable_block_reuse": True})
    eagle3_one_model: bool = True
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    acceptance_window: int | None = None         # guard: switch speculation off when acceptance collapses
    min_acceptance_rate: float | None = None
    enable_chunked_prefill: bool = False         # written only when True (TensorRT-LLM's default is False)
    sa_config: dict | None = None                # the suffix-automaton enhancer (runtime/trtllm/sa_enhancer.py)
    sa_note: str | None = None                   # why it is or is not written

    @property
    def release(self) -> compat.Release:
        return compat.release(self.version)

    @property
    def mode(self) -> compat.Mode:
        return self.release.mode(self.algorithm, self.eagle3_one_model)


def draft_kv_cache(mode: compat.Mode, kv_dtype: str, target_kv_fp8: bool) -> str | None:
    """The draft's KV cache as TensorRT-LLM runs it: in one-model mode the target's KV-cache quantization ("fp8" when
    `kv_cache_config.dtype` is fp8, or auto and the target checkpoint's kv_cache_quant_algo is FP8; unit scales:
    runtime.engine.drafts.loading.DRAFT_KV_FP8_SCALE), else "bf16"; None for two-model (not read from the source)."""
    if mode != "one_model":
        return None
    return "fp8" if kv_dtype == "fp8" or (kv_dtype == "auto" and target_kv_fp8) else "bf16"


def acceptance_guard(rel: compat.Release, mode: compat.Mode, window: int | None, min_rate: float | None,
                     max_draft_len: int) -> tuple[dict, str | None]:
    """The guard's keys in the version's terms, and a note when it is not written. 1.2 thresholds the rolling
    mean of accepted draft tokens per iteration (decoded tokens per iteration - 1) = rate x draft length; 1.3 a
    rate accepted / drafted (compat.SOURCES acceptance_guard_1_2 / _1_3). AL = 1 + rate x k."""
    if not window or min_rate is None:
        return {}, None
    if mode not in rel.acceptance_guard_modes:
        return {}, (f"acceptance_guard not written: TensorRT-LLM {rel.line} evaluates it only in "
                    f"{'/'.join(sorted(rel.acceptance_guard_modes))} mode (this deployment is {mode.replace('_', '-')})")
    value = float(min_rate) if rel.acceptance_threshold_kind == "rate" else round(float(min_rate) * max_draft_len, 6)
    return {rel.acceptance_window_key: int(window), rel.acceptance_threshold_key: value}, None


def prompt_limits(max_num_tokens: int, max_seq_len: int | None, positions: int, chunked_prefill: str,
                  log) -> tuple[int, bool]:
    """(max_seq_len, enable_chunked_prefill) for `build.chunked_prefill` (auto | on | off). Without chunked prefill the
    PyTorch backend refuses every prompt longer than max_num_tokens (checks.prompt_rejection): auto turns it on where
    a prompt of max_seq_len - 1 tokens would be refused; off caps a default max_seq_len at max_num_tokens instead."""
    msl = max_seq_len or positions
    if chunked_prefill == "off" and not max_seq_len and msl > max_num_tokens:
        log.info("build.chunked_prefill: off: max_seq_len capped at max_num_tokens %d (the models cover %d): longer "
                 "prompts would be refused by TensorRT-LLM's PyTorch backend", max_num_tokens, msl)
        msl = max_num_tokens
    chunked = chunked_prefill == "on" or (chunked_prefill == "auto" and msl - 1 > max_num_tokens)
    if chunked and chunked_prefill == "auto":
        log.info("enable_chunked_prefill: true: max_seq_len %d allows prompts longer than max_num_tokens %d, which "
                 "TensorRT-LLM's PyTorch backend refuses without chunked prefill", msl, max_num_tokens)
    return int(msl), chunked


def llm_api_options(spec: DeploymentSpec) -> dict:
    """The extra_llm_api_options dict (no `model`/`backend`: those are command-line arguments of trtllm-serve
    and trtllm-bench, and are added to Triton's model.yaml by the export). Without speculation (the schedule
    never drafts) there is no speculative_config."""
    rel, mode = spec.release, spec.mode
    opts: dict = {
        "tensor_parallel_size": spec.tensor_parallel_size,
        "pipeline_parallel_size": spec.pipeline_parallel_size,
        "max_batch_size": spec.max_batch_size,
        "max_num_tokens": spec.max_num_tokens,
        "max_seq_len": spec.max_seq_len,
        "kv_cache_config": dict(spec.kv_cache),
    }
    if spec.enable_chunked_prefill:
        # prompts longer than max_num_tokens are prefilled over several iterations instead of being refused
        # (checks.prompt_rejection, compat.SOURCES prompt_vs_max_num_tokens)
        opts["enable_chunked_prefill"] = True
    if spec.cuda_graph_batch_sizes:
        # batch_sizes only: with max_batch_size too, 1.2 requires batch_sizes to equal its generated list
        opts["cuda_graph_config"] = {"enable_padding": spec.cuda_graph_padding,
                                     "batch_sizes": sorted(set(spec.cuda_graph_batch_sizes))}
    opts["enable_iter_perf_stats"] = True          # llm.get_stats() -> specDecodingStats
    if not spec.schedule.speculates(spec.max_batch_size):
        return opts
    sc: dict = {"decoding_type": rel.decoding_types.get(spec.algorithm, spec.algorithm)}
    sc.update(draft_schedule.encode(spec.schedule, rel, mode, spec.max_batch_size))
    sc["speculative_model"] = spec.draft_dir
    algo = get_algorithm(spec.algorithm)
    if algo.trtllm_layers_to_capture:
        if rel.emits_eagle3_one_model:
            sc["eagle3_one_model"] = spec.eagle3_one_model
        if spec.capture_layers is not None:
            # Always: TensorRT-LLM reads neither the draft config's aux layer ids nor sizes fc from them; unset it
            # assumes 3 layers (1, L//2-1, L-4) and raises for L <= 5 (compat.SOURCES layers_to_capture)
            sc["eagle3_layers_to_capture"] = sorted(set(int(i) for i in spec.capture_layers))
    guard, _ = acceptance_guard(rel, mode, spec.acceptance_window, spec.min_acceptance_rate, sc["max_draft_len"])
    sc.update(guard)
    if spec.sa_config:
        sc["sa_config"] = dict(spec.sa_config)
    if algo.trtllm_two_model and mode == "two_model":
        opts["disable_overlap_scheduler"] = True   # two-model EAGLE-3 runs only with it disabled
    opts["speculative_config"] = sc
    return opts


def sa_config_of(tuning: dict, version: str, algorithm: str, speculation: bool) -> tuple[dict | None, str]:
    """(sa_config to write or None, why) from tuning.json's `sa_enhancer` (runtime/cost/hybrid.py) for `version`:
    written only where tune chose it and the version has the field; refused with the reason (and what vLLM runs
    instead) where tune found it paying but the version lacks it."""
    from runtime.trtllm import sa_enhancer

    t = tuning.get("sa_enhancer") or {}
    if not speculation or not t.get("measured"):
        return None, "not written: " + ("no speculation" if not speculation else t.get("why") or "tune did not price it")
    if (p := sa_enhancer.problem(version, algorithm)) is not None:
        paying = t.get("why", "").split("; not deployable")[0]
        return None, (f"refused: {p}" + (f" (tune found it paying: {paying})" if t.get("pays") else "")
                      + "; " + t.get("vllm_alternative", sa_enhancer.vllm_alternative(1)))
    if not t.get("deploy"):
        return None, "not written: " + t.get("why", "")
    return sa_enhancer.sa_config(int(t["threshold"])), "written: " + t.get("why", "")


def options_yaml(options: dict, version: str) -> str:
    """deployment/llm_api_options.yaml: the options with a header saying what they are and how to use them."""
    return (f"# LLM-API options for TensorRT-LLM {version} (PyTorch backend), written by specpipe build.\n"
            f"# Use: trtllm-serve <target> --backend pytorch --extra_llm_api_options llm_api_options.yaml\n"
            + dump_yaml(options))


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
