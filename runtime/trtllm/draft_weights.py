"""The EAGLE-3 draft as the targeted TensorRT-LLM loader reads it: which tensors to rename, and a renamed copy
of the checkpoint (safetensors headers rewritten, data bytes copied unchanged)."""
from __future__ import annotations

import json
import re
import struct
from pathlib import Path

from runtime.trtllm import compat


def safetensors_tensors(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape from a safetensors header (no torch, no weight bytes read)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}


def safetensors_dtypes(path: Path) -> dict[str, str]:
    """Tensor name -> safetensors dtype string (F8_E4M3, BF16, ...) from the header."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: v["dtype"] for k, v in header.items() if k != "__metadata__"}


def draft_weight_renames(names: list[str], rel: compat.Release, num_layers: int) -> dict[str, str]:
    """EAGLE-3 draft tensors to rename so that `rel`'s loader finds them (old name -> new name). ModelOpt writes
    `layers.<i>.*`; TensorRT-LLM's module is `midlayer` (one layer) or `midlayer.<i>` (several). The 1.3 loader
    remaps the ModelOpt names itself (PR #11010); the 1.2 one matches names only after prefixing `model.`, and
    skips tensors that match no module (compat.SOURCES draft_weight_names)."""
    if rel.eagle3_draft_layer_prefix != "midlayer":
        return {}
    out = {}
    for n in names:
        m = re.match(r"^layers\.(\d+)\.(.*)$", n)
        if m:
            out[n] = f"midlayer.{m.group(2)}" if num_layers == 1 else f"midlayer.{m.group(1)}.{m.group(2)}"
    return out


def rename_safetensors(src: Path, dst: Path, renames: dict[str, str]) -> int:
    """Copy a safetensors file with some tensors renamed: the header is rewritten, the data bytes are copied
    unchanged (offsets are relative to the data section). Returns the number of renamed tensors."""
    with open(src, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        new = {renames.get(k, k): v for k, v in header.items()}
        if len(new) != len(header):
            raise ValueError(f"{src}: renaming would merge tensors")
        raw = json.dumps(new, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(dst, "wb") as out:
            out.write(struct.pack("<Q", len(raw)))
            out.write(raw)
            while chunk := f.read(1 << 24):
                out.write(chunk)
    return sum(1 for k in header if k in renames)


def trtllm_draft_dir(src: Path, dst: Path, rel: compat.Release, num_layers: int) -> tuple[Path, int]:
    """The draft directory TensorRT-LLM loads: `src` itself when its tensor names are the ones the targeted
    loader reads, else a copy in `dst` with the renames (config and other files copied as is, the tokenizer in its
    portable form), world-readable."""
    import shutil

    from runtime.files import publish_tree
    from runtime.text.tokenizer_files import portable_tokenizer

    files = sorted(src.glob("*.safetensors"))
    names = [n for f in files for n in safetensors_tensors(f)]
    renames = draft_weight_renames(names, rel, num_layers)
    if not renames:
        return src, 0
    dst.mkdir(parents=True)
    n = 0
    for f in sorted(p for p in src.iterdir() if p.is_file()):
        if f.suffix == ".safetensors":
            n += rename_safetensors(f, dst / f.name, renames)
        elif f.name == "model.safetensors.index.json":
            idx = json.loads(f.read_text())
            idx["weight_map"] = {renames.get(k, k): v for k, v in (idx.get("weight_map") or {}).items()}
            (dst / f.name).write_text(json.dumps(idx, indent=2))
        else:
            shutil.copy2(f, dst / f.name)
    portable_tokenizer(dst)
    publish_tree(dst)
    return dst, n
