"""Loading a written deployment: `LLM(...)` from the LLM-API options where TensorRT-LLM and a CUDA GPU exist.
Never faked: elsewhere the result says plainly that the deployment was written, not loaded."""
from __future__ import annotations

from pathlib import Path

NOT_LOADED = "TensorRT-LLM not available: deployment written, not loaded"


def try_load(target_dir: Path, options: dict) -> dict:
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
        res = {"loaded": True, "tensorrt_llm": tensorrt_llm.__version__, "warmup_text": out.outputs[0].text}
        sd = getattr(out.outputs[0].request_perf_metrics, "speculative_decoding", None)
        if sd is not None and options.get("speculative_config"):
            res.update(acceptance_rate=sd.acceptance_rate, total_draft_tokens=sd.total_draft_tokens,
                       total_accepted_draft_tokens=sd.total_accepted_draft_tokens)
        return res
    finally:
        llm.shutdown()
