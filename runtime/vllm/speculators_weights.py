"""The draft's tensors in the speculators format: ModelOpt's export read and checked (no FP8; the export valid as
runtime/algorithms/ defines it), the verifier's embeddings copied from the target checkpoint, the reduced-vocabulary
maps `d2t`/`t2d`, and the one safetensors file written."""
from __future__ import annotations

import json
from pathlib import Path

from runtime.algorithms.export import SCALE_SUFFIXES
from runtime.vllm.speculators_config import SpeculatorsFormatError

WEIGHTS_FILE = "model.safetensors"


def read_draft(draft_dir: Path) -> tuple[dict, dict]:
    from runtime.engine.drafts import DraftFormatError, read_draft_dir

    try:
        return read_draft_dir(draft_dir)
    except DraftFormatError as e:
        raise SpeculatorsFormatError(str(e)) from None


def stored_dtype(cfg: dict, sd: dict) -> str | None:
    """The dtype the weights are stored in (a loader casts to the config's dtype: a wrong claim rounds them)."""
    stored = {str(v.dtype).replace("torch.", "") for v in sd.values() if v.is_floating_point()}
    return stored.pop() if len(stored) == 1 else (cfg.get("torch_dtype") or cfg.get("dtype"))


def check_draft(cfg: dict, sd: dict, algorithm, where: str) -> None:
    """The ModelOpt export as its algorithm defines it (runtime/algorithms/: `check_export`, the first problem raised),
    and not FP8: the speculators library cannot run ModelOpt's FP8 weights."""
    import torch

    from runtime.algorithms.export import raise_first, read_export
    from runtime.algorithms.registry import check_export

    if quant := sorted(k for k in sd if k.rsplit(".", 1)[-1] in SCALE_SUFFIXES or sd[k].dtype == torch.float8_e4m3fn):
        raise SpeculatorsFormatError(f"{where}: FP8-quantized tensors {quant[:4]}: the speculators library cannot run "
                                     "ModelOpt FP8 weights; write the speculators draft from the BF16 draft "
                                     "(train_draft/draft)")
    raise_first(check_export(read_export(sd, cfg, where), algorithm=algorithm), SpeculatorsFormatError)


def verifier_tensor(target_dir: Path, suffix: str):
    """A tensor of the target checkpoint whose name ends with `suffix` (e.g. `model.embed_tokens.weight`), read
    from the safetensors shard that holds it; an FP8-quantized one is refused (ModelOpt keeps embeddings in BF16)."""
    import torch
    from safetensors import safe_open

    idx = target_dir / "model.safetensors.index.json"
    files = (sorted({target_dir / f for f in json.loads(idx.read_text())["weight_map"].values()}) if idx.exists()
             else sorted(target_dir.glob("*.safetensors")))
    for f in files:
        with safe_open(str(f), "pt") as h:
            names = sorted((k for k in h.keys() if k == suffix or k.endswith("." + suffix)), key=len)
            if names:
                t = h.get_tensor(names[0])
                if t.dtype == torch.float8_e4m3fn:
                    raise SpeculatorsFormatError(f"{f}: {names[0]} is FP8; the draft needs the BF16 embeddings")
                return t
    raise SpeculatorsFormatError(f"{target_dir}: no tensor named *{suffix} in {[f.name for f in files]}")


def verifier_embeddings(target_dir: Path, V: int, H: int):
    embed = verifier_tensor(target_dir, "embed_tokens.weight")
    if tuple(embed.shape) != (V, H):
        raise SpeculatorsFormatError(f"{target_dir}: embed_tokens is {tuple(embed.shape)}, the draft needs ({V}, {H})")
    return embed.contiguous()


def vocab_map(sd: dict, dv: int, V: int) -> dict:
    """`d2t` (int64) and `t2d` (bool over the target vocabulary) for a reduced draft vocabulary; {} for a full one.
    The d2t was checked by `check_draft` (runtime/algorithms/eagle3.py's rule)."""
    import torch

    from runtime.algorithms.eagle3 import t2d_of

    if dv >= V:
        return {}
    d2t = sd["d2t"].to(torch.int64).contiguous()
    return {"d2t": d2t, "t2d": t2d_of(d2t, V)}


def save(out_dir: Path, tensors: dict, doc: dict) -> None:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    (out_dir / WEIGHTS_FILE).chmod(0o644)      # safetensors writes 0600: a container user other than ours must read it
    (out_dir / "config.json").write_text(json.dumps(doc, indent=2) + "\n")
