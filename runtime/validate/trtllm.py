"""Acceptance measured through TensorRT-LLM's LLM API (PyTorch backend) with the same speculative config as the
deployment: whether it is usable here, the LLM(...) and SamplingParams(...) arguments (checked against the extracted
schemas in tests), and the measurement itself (only inside a TensorRT-LLM installation with a GPU)."""
from __future__ import annotations

import json
import time
from pathlib import Path

from runtime.algorithms.base import Algorithm
from runtime.algorithms.registry import get as get_algorithm
from runtime.validate.decode import MeasureSettings


def trtllm_available() -> tuple[bool, str]:
    """(whether the tensorrt_llm runtime is usable here, why not)."""
    import importlib.util

    if importlib.util.find_spec("tensorrt_llm") is None:
        return False, "tensorrt_llm is not installed"
    import torch

    if not torch.cuda.is_available():
        return False, "no CUDA GPU"
    return True, "available"


TRTLLM_SPEC_CLASSES = {"Eagle3": "Eagle3DecodingConfig", "DFlash": "DFlashDecodingConfig"}


def trtllm_llm_kwargs(target_dir, draft_dir, *, algorithm: str | Algorithm, max_draft_len: int, num_target_layers: int,
                      aux_layer_ids: list[int] | None, batch_size: int, max_seq_len: int) -> dict:
    """LLM(...) arguments for measuring acceptance with TensorRT-LLM (PyTorch backend, LLM API), field names
    as in `schemas/trtllm-1.2-llmapi.json` (DFlash needs 1.3+)."""
    algo = get_algorithm(algorithm)
    spec: dict = {"decoding_type": algo.trtllm_decoding_type,
                  "max_draft_len": max_draft_len, "speculative_model": str(draft_dir)}
    if algo.trtllm_layers_to_capture:
        spec["eagle3_one_model"] = True
        if aux_layer_ids is None:
            raise ValueError(f"the {algo.title} draft's config.json names no {algo.capture_key}")
        # always: unset, TensorRT-LLM captures (1, L//2-1, L-4) and sizes fc for 3 layers, whatever the draft was
        # trained on (runtime/trtllm/compat.py SOURCES["layers_to_capture"])
        spec["eagle3_layers_to_capture"] = list(aux_layer_ids)
    return {
        "model": str(target_dir), "backend": "pytorch", "max_batch_size": batch_size,
        "max_num_tokens": max(8192, batch_size * (1 + max_draft_len), batch_size * max_seq_len),
        "max_seq_len": max_seq_len, "kv_cache_config": {"free_gpu_memory_fraction": 0.7},
        "enable_iter_perf_stats": True, "speculative_config": spec,
    }


def trtllm_sampling_kwargs(*, max_new_tokens: int, temperature: float, seed: int,
                           stop_token_ids: list[int] | None = None) -> dict:
    """SamplingParams(...) arguments (end token: the tokenizer's eos, TensorRT-LLM's default; `stop_token_ids`:
    every id that ends a generation, e.g. an instruct model's end-of-turn, SamplingParams.stop_token_ids in
    tensorrt_llm/sampling_params.py)."""
    kw = {"max_tokens": max_new_tokens, "return_perf_metrics": True, "seed": seed}
    if stop_token_ids:
        kw["stop_token_ids"] = list(stop_token_ids)
    if temperature > 0:
        kw["temperature"] = temperature
    else:
        kw["top_k"] = 1                  # greedy
    return kw


def run_trtllm(s: MeasureSettings, deployed: dict, bf16: dict | None, prompts: dict, eos, *,
               scratch_dir: Path) -> dict:  # pragma: no cover - needs a GPU
    """The acceptance of the deployed pair (and `bf16`, when given) per domain through TensorRT-LLM's LLM API
    (`scratch_dir`: the EAGLE-3 draft renamed for the installed loader). Runs only inside a TensorRT-LLM installation
    with a GPU; this machine never gets here."""
    import tensorrt_llm
    from tensorrt_llm import LLM, SamplingParams, llmapi

    from runtime.engine.drafts import draft_traits
    from runtime.trtllm import compat
    from runtime.trtllm.draft_weights import trtllm_draft_dir

    res: dict = {"domains": {d: {} for d in prompts}, "overall": {}, "trtllm_version": tensorrt_llm.__version__,
                 "lossless": {"checked_prompts": 0, "passed": None, "note": "not checked by the tensorrt_llm runtime"}}
    for label, pair in [("fp8", deployed)] + ([("bf16", bf16)] if bf16 else []):
        dcfg = json.loads((Path(pair["draft_dir"]) / "config.json").read_text())
        tcfg = json.loads((Path(pair["target_dir"]) / "config.json").read_text())
        algo = draft_traits(pair["draft_dir"])
        K = min(s.max_draft_len, algo.draft_len_cap(dcfg.get("block_size")) or s.max_draft_len)
        longest = max(len(p) for ps in prompts.values() for p in ps)
        draft_dir = Path(pair["draft_dir"])
        if algo.trtllm_renamed_weights:   # the layer names the installed loader reads (build does the same for the deployment)
            draft_dir, _ = trtllm_draft_dir(draft_dir, scratch_dir / f"trtllm_draft_{label}",
                                            compat.release(compat.normalize_version(tensorrt_llm.__version__)),
                                            int(dcfg.get("num_hidden_layers") or 1))
        kw = trtllm_llm_kwargs(pair["target_dir"], draft_dir, algorithm=algo, max_draft_len=K,
                               num_target_layers=tcfg["num_hidden_layers"],
                               aux_layer_ids=algo.capture_layers(dcfg),
                               batch_size=s.batch_size, max_seq_len=longest + s.max_new_tokens + K + 8)
        spec = kw.pop("speculative_config")
        cls = getattr(llmapi, TRTLLM_SPEC_CLASSES[spec.pop("decoding_type")])
        llm = LLM(**kw, speculative_config=cls(**spec))
        sp = SamplingParams(**trtllm_sampling_kwargs(max_new_tokens=s.max_new_tokens, temperature=s.temperature,
                                                     seed=s.seed, stop_token_ids=eos))
        tot = {"drafted": 0, "accepted": 0, "tokens": 0}
        for d, ps in prompts.items():
            t0 = time.perf_counter()
            outs = llm.generate(ps, sampling_params=sp)
            wall = time.perf_counter() - t0
            drafted = sum(o.request_perf_metrics.speculative_decoding.total_draft_tokens for o in outs)
            accepted = sum(o.request_perf_metrics.speculative_decoding.total_accepted_draft_tokens for o in outs)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            steps = drafted / K if K else 0
            res["domains"][d][label] = {"acceptance_length": round(1 + accepted / steps, 6) if steps else 1.0,
                                        "draft_acceptance_rate": round(accepted / drafted, 6) if drafted else None,
                                        "drafted": drafted, "accepted": accepted, "steps": steps, "output_tokens": tokens,
                                        "per_position": None, "wall_s": round(wall, 3)}
            tot["drafted"] += drafted
            tot["accepted"] += accepted
            tot["tokens"] += tokens
        steps = tot["drafted"] / K if K else 0
        res["overall"][label] = {"acceptance_length": round(1 + tot["accepted"] / steps, 6) if steps else 1.0,
                                 "draft_acceptance_rate": round(tot["accepted"] / tot["drafted"], 6) if tot["drafted"] else None,
                                 "drafted": tot["drafted"], "accepted": tot["accepted"], "output_tokens": tot["tokens"],
                                 "per_position": None}
        res["draft_len"] = K
        del llm
    return res
