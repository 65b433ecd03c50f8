"""Recognising a ModelOpt FP8 checkpoint: the `quantization` block TensorRT-LLM reads (hf_quant_config.json, or
config.json's `quantization_config`), its recipe (`quant_algo`), the names of scale tensors, and reading every
safetensors shard of a checkpoint."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from runtime.quant import hf_quant_config

SCALE_SUFFIXES = ("weight_scale", "input_scale", "k_scale", "v_scale", "output_scale")

# hf_quant_config.json quant_algo -> how activations are quantized (ModelOpt 0.47 export names; TensorRT-LLM 1.2
# QuantAlgo.FP8 = FP8QDQLinearMethod, QuantAlgo.FP8_PER_CHANNEL_PER_TOKEN = FP8RowwiseLinearMethod)
QUANT_ALGOS = {"FP8": "static", "FP8_PER_CHANNEL_PER_TOKEN": "dynamic_per_token"}


def read_quant_config(path: str | Path) -> dict | None:
    """The `quantization` block of a checkpoint's `hf_quant_config.json` (what TensorRT-LLM reads), or None.

    Falls back to `config.json["quantization_config"]` (ModelOpt writes both; the flat `quant_method: modelopt`
    form carries the same `quant_algo` / `kv_cache_scheme`) so a checkpoint missing the file is still recognised
    here; `stages.quantize` checks separately that the file exists, since TensorRT-LLM 1.2 needs it.
    """
    path = Path(path)
    block = hf_quant_config.read(path)
    if block is not None:
        return block
    cfg_file = path / "config.json"
    if cfg_file.exists():
        qc = json.loads(cfg_file.read_text()).get("quantization_config")
        if isinstance(qc, dict) and qc.get("quant_method") == "modelopt":
            kv = qc.get("kv_cache_scheme")
            return {"quant_algo": qc.get("quant_algo"), "exclude_modules": qc.get("ignore", []),
                    "kv_cache_quant_algo": "FP8" if isinstance(kv, dict) and kv.get("type") == "float" else None}
    return None


def quant_algo(path: str | Path) -> str | None:
    """`quant_algo` of the checkpoint's `hf_quant_config.json` (upper case), or None when the file is absent."""
    return hf_quant_config.quant_algo(path)


def is_fp8_checkpoint(path: str | Path) -> bool:
    """True when `path` is a ModelOpt FP8 checkpoint: `hf_quant_config.json` with a `quant_algo` of
    `QUANT_ALGOS` (FP8 per-tensor, or FP8_PER_CHANNEL_PER_TOKEN)."""
    return quant_algo(path) in QUANT_ALGOS


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (every `*.safetensors` shard) or of one safetensors file."""
    from safetensors.torch import load_file

    path = Path(path)
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors under {path}")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(str(f)))
    return sd
