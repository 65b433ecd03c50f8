"""The one reader of a checkpoint's `hf_quant_config.json`: the file ModelOpt 0.47's `export_hf_checkpoint` writes
beside an FP8 checkpoint and TensorRT-LLM 1.2 reads to load it quantized (its `quantization` block: `quant_algo`,
`kv_cache_quant_algo`, `exclude_modules`).

Every part of specpipe that needs the recipe of a checkpoint (the runtime's FP8 loader, quantize's format checks and
artifact, build's TensorRT-LLM checks, export's vLLM command) reads it here, with one behaviour: the `quantization`
block (a flat document is taken as the block itself), None when the file is absent, and an `HFQuantConfigError` that
names the file when it is not a JSON object."""
from __future__ import annotations

import json
from pathlib import Path

FILE = "hf_quant_config.json"


class HFQuantConfigError(ValueError):
    """hf_quant_config.json exists but cannot be read as a JSON object; the message names the file."""


def read(path: str | Path) -> dict | None:
    """The `quantization` block of `path/hf_quant_config.json`, or None when `path` has no such file."""
    f = Path(path) / FILE
    if not f.exists():
        return None
    try:
        doc = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise HFQuantConfigError(f"{f}: not readable as JSON ({e}); re-export the checkpoint (specpipe build "
                                 "reruns quantize when its artifact is removed)") from None
    if not isinstance(doc, dict):
        raise HFQuantConfigError(f"{f}: expected a JSON object with a `quantization` block, found {type(doc).__name__}")
    block = doc.get("quantization", doc)
    if not isinstance(block, dict):
        raise HFQuantConfigError(f"{f}: `quantization` must be an object, found {type(block).__name__}")
    return block


def quant_algo(path: str | Path) -> str | None:
    """`quant_algo` (upper case) of `path`'s hf_quant_config.json; None when the file or the field is absent."""
    algo = (read(path) or {}).get("quant_algo")
    return str(algo).upper() if algo else None


def kv_cache_quant_algo(path: str | Path) -> str | None:
    """`kv_cache_quant_algo` (upper case) of `path`'s hf_quant_config.json; None when the file or the field is absent
    (a BF16 KV cache)."""
    algo = (read(path) or {}).get("kv_cache_quant_algo")
    return str(algo).upper() if algo else None
