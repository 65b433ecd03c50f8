"""What every algorithm's export check shares: the export read once (config.json, tensor names, shapes and dtypes,
values on demand) from a directory or from tensors in memory, the `Problem` a check reports, the named error, the
target a draft is paired with, and `check_export` dispatching on the architecture config.json declares."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# ModelOpt writes quantization scales beside the quantized weights (modelopt/torch/export/unified_export_hf.py);
# a check of names looks through them ("quantized eagle are allowed to have scales", hf_spec_export.py)
SCALE_SUFFIXES = ("weight_scale", "input_scale", "k_scale", "v_scale", "weight_scale_2", "pre_quant_scale")
# the decoder-layer tensors (HF Llama names) both EAGLE-3 and DFlash exports carry per layer
LAYER_TENSORS = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                 "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_ST_DTYPES = {"I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
              "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
              "F8_E5M2": "float8_e5m2"}


class DraftExportError(ValueError):
    """An export is not a valid draft of its algorithm; the message names the directory and what to do."""


@dataclass(frozen=True)
class Problem:
    """One thing wrong with an export: `check` names the rule (callers group by it), `message` says where, what
    was expected and found, and what it breaks; `code` tells apart problems of one check a caller may tolerate."""

    check: str
    message: str
    code: str = ""


@dataclass
class TargetShape:
    """What a draft must agree with: read from the target's config."""

    hidden_size: int
    vocab_size: int
    num_layers: int


@dataclass
class Export:
    """An export as the checks read it. `shapes`: tensor name -> (shape, dtype name as torch spells it);
    `tensor(name)` loads one tensor's values (only d2t's are ever read)."""

    where: str
    cfg: dict
    shapes: dict[str, tuple[tuple[int, ...], str]]
    tensor: Callable

    def names(self) -> set[str]:
        """Tensor names without quantization scales."""
        return {k for k in self.shapes if k.rsplit(".", 1)[-1] not in SCALE_SUFFIXES}


def read_export(src, cfg: dict | None = None, where: str | None = None) -> Export:
    """An `Export` from a directory (config.json + *.safetensors headers; an adapter_model.safetensors beside the
    weights is ModelOpt's LoRA export, not the draft) or from `cfg` and a dict of tensors `src`. Raises
    DraftExportError when the directory has no readable config.json or no weights."""
    if isinstance(src, dict):
        import torch

        return Export(where or "<tensors>", dict(cfg or {}),
                      {k: (tuple(v.shape), str(v.dtype).replace("torch.", "")) for k, v in src.items()},
                      lambda n: src[n] if isinstance(src[n], torch.Tensor) else torch.as_tensor(src[n]))
    path = Path(src)
    where = where or str(path)
    if cfg is None:
        try:
            cfg = json.loads((path / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise DraftExportError(f"{where}/config.json: cannot read the draft config ({e}); expected a draft "
                                   "directory written by ModelOpt's export_speculative_decoding") from None
    files = [f for f in sorted(path.glob("*.safetensors")) if f.name != "adapter_model.safetensors"]
    if not files:
        raise DraftExportError(f"{where}: no *.safetensors weights")
    shapes, owner = {}, {}
    for f in files:
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        for k, v in header.items():
            if k != "__metadata__":
                shapes[k] = (tuple(v["shape"]), _ST_DTYPES.get(v["dtype"], v["dtype"].lower()))
                owner[k] = f

    def tensor(name):
        from safetensors import safe_open

        with safe_open(str(owner[name]), "pt") as sf:
            return sf.get_tensor(name)

    return Export(where, cfg, shapes, tensor)


def raise_first(problems: list[Problem], error=DraftExportError) -> None:
    """Raise `error` with the first problem's message (the order of a check is the order a reader fixes them)."""
    if problems:
        raise error(problems[0].message)
