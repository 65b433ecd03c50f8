"""Writing a quantized model as the deployment reads it: ModelOpt's unified Hugging Face export in float32 (exact
E4M3 codes), the unquantized tensors stored in the deployment dtype afterwards, RoPE fields in TensorRT-LLM's form,
and the source model's tokenizer files copied next to the weights (in the form every targeted TensorRT-LLM reads,
runtime/text/tokenizer_files.py), every file world-readable (runtime/files.py publish_tree)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from runtime.files import publish_tree

WEIGHT_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json", "hf_quant_config.json")


def export_target(model, out_dir: Path, source_dir: Path, dtype) -> None:
    """`export_hf_checkpoint` + the source model's tokenizer files (the deployment loads them from here)."""
    import torch
    from modelopt.torch.export import export_hf_checkpoint

    # FP8 weights are computed as weight.to(export dtype) / weight_scale: in bfloat16 that division rounds twice
    # (bf16, then E4M3) and ~2% of weights land one FP8 step away from what was calibrated. Export in float32
    # (exact division, the same E4M3 values as ModelOpt's fake-quant model), then store the rest in `dtype`.
    export_hf_checkpoint(model, dtype=torch.float32, export_dir=out_dir)
    cast_high_precision(out_dir, lambda k, v: dtype)
    cfg = json.loads((out_dir / "config.json").read_text())
    cfg["dtype"] = str(dtype).replace("torch.", "")
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    from runtime.hf_config import normalize_file  # RoPE in the form TensorRT-LLM 1.2 and 1.3 read
    normalize_file(out_dir / "config.json")
    copy_tokenizer(source_dir, out_dir)
    publish_tree(out_dir)


def cast_high_precision(out: Path, dtype_for) -> int:
    """ModelOpt's exporters store the tensors they do not quantize (embeddings, lm_head, norms, excluded
    modules) in the calibration dtype (float32 on CPU) whatever `dtype` says; store them as `dtype_for(name,
    tensor)` (the deployment dtype). FP8 weights and float32 scales are left alone. Returns how many changed."""
    from safetensors.torch import save_file

    from runtime.engine.fp8 import FP8_DTYPE, SCALE_SUFFIXES, read_safetensors

    sd = read_safetensors(out)
    n = 0
    for k, v in sd.items():
        if v.dtype == FP8_DTYPE or not v.is_floating_point() or k.rsplit(".", 1)[-1] in SCALE_SUFFIXES:
            continue
        want = dtype_for(k, v)
        if v.dtype != want:
            sd[k] = v.to(want)
            n += 1
    if n:
        for f in out.glob("*.safetensors"):
            f.unlink()
        (out / "model.safetensors.index.json").unlink(missing_ok=True)
        save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    return n


def copy_tokenizer(src: Path, dst: Path) -> list[str]:
    """The source's non-weight files (tokenizer, chat template) into `dst`; tokenizer_config.json in its portable form."""
    from runtime.text.tokenizer_files import portable_tokenizer

    copied = []
    for p in sorted(Path(src).iterdir()):
        if p.is_file() and p.suffix != ".safetensors" and p.name not in WEIGHT_FILES and not (dst / p.name).exists():
            shutil.copy2(p, dst / p.name)
            copied.append(p.name)
    portable_tokenizer(dst)
    return copied
