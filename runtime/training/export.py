"""The trained draft's export: ModelOpt's `export_speculative_decoding` in the export dtype (in the worker, rank 0),
then, in the stage, the target's tokenizer files beside it and its config.json's RoPE in the form TensorRT-LLM
reads (`complete_export`). The named checks of the result are `runtime.training.draft_checks`."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from runtime.algorithms.dflash import DFLASH
from runtime.algorithms.eagle3 import EAGLE3
from runtime.training.job import torch_dtype
from runtime.training.model import draft_module


def export_draft(job: dict, model) -> Path:
    """`export_speculative_decoding` into `export_dir`, in the export dtype. Returns the directory."""
    export_dir = Path(job["export_dir"])
    export_dir.mkdir(parents=True, exist_ok=True)
    _EXPORT[job["algorithm"]["name"]](job, model, torch_dtype(job["export_dtype"]), export_dir)
    return export_dir


def _export_eagle3(job: dict, model, dtype, export_dir: Path) -> None:
    from modelopt.torch.export import export_speculative_decoding

    if job.get("_fsdp"):   # only the draft (and the lm_head it may share) is exported; the target stays sharded
        draft_module(model).to(dtype)
        model.get_output_embeddings().to(dtype)
    else:
        model.to(dtype)   # EagleExporter writes the state dict as is
    export_speculative_decoding(model, export_dir=str(export_dir))


def _export_dflash(job: dict, model, dtype, export_dir: Path) -> None:
    from modelopt.torch.export import export_speculative_decoding

    export_speculative_decoding(model, dtype=dtype, export_dir=str(export_dir))   # DFlashExporter casts to dtype


# ModelOpt's exporter per algorithm (they differ in who casts to the export dtype)
_EXPORT = {EAGLE3.name: _export_eagle3, DFLASH.name: _export_dflash}


def complete_export(draft_dir: Path, model_dir: Path) -> dict:
    """The target's tokenizer files beside the export (tokenizer_config.json in the form every targeted TensorRT-LLM
    reads, runtime/text/tokenizer_files.py), its config.json's RoPE in the form TensorRT-LLM 1.2 and 1.3 read, every
    file world-readable. Returns that config."""
    from runtime.files import publish_tree
    from runtime.hf_config import normalize_file
    from runtime.text.tokenizer_files import TOKENIZER_FILES, portable_tokenizer

    for name in TOKENIZER_FILES:
        if (model_dir / name).exists():
            shutil.copy2(model_dir / name, draft_dir / name)
    portable_tokenizer(draft_dir)
    normalize_file(draft_dir / "config.json")
    publish_tree(draft_dir)
    return json.loads((draft_dir / "config.json").read_text())


def tensor_names(d: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), "pt") as f:
        return set(f.keys())
