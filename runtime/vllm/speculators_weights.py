"""The draft's tensors in the speculators format: ModelOpt's export read and checked (no FP8, every tensor the
format names and no other), the verifier's embeddings copied from the target checkpoint, the reduced-vocabulary
maps `d2t`/`t2d`, and the one safetensors file written."""
from __future__ import annotations

import json
from pathlib import Path

from runtime.vllm.speculators_config import SpeculatorsFormatError

WEIGHTS_FILE = "model.safetensors"
_SCALE_SUFFIXES = ("weight_scale", "input_scale", "k_scale", "v_scale", "weight_scale_2", "pre_quant_scale")
LAYER_TENSORS = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                  "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


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


def check_tensors(sd: dict, required: set[str], optional: set[str], where: str) -> None:
    import torch

    if quant := sorted(k for k in sd if k.rsplit(".", 1)[-1] in _SCALE_SUFFIXES or sd[k].dtype == torch.float8_e4m3fn):
        raise SpeculatorsFormatError(f"{where}: FP8-quantized tensors {quant[:4]}: the speculators library cannot run "
                                     "ModelOpt FP8 weights; write the speculators draft from the BF16 draft "
                                     "(train_draft/draft)")
    allowed = required | optional | {k[:-len(".weight")] + ".bias" for k in required if k.endswith(".weight")}
    if missing := sorted(required - set(sd)):
        raise SpeculatorsFormatError(f"{where}: missing tensors {missing[:8]}")
    if unexpected := sorted(set(sd) - allowed):
        raise SpeculatorsFormatError(f"{where}: tensors {unexpected[:8]} have no place in the speculators format "
                                     "(vLLM's loader would fail on an unknown name)")


def check_fc(sd: dict, hidden: int, mo_ids: list[int], layers: str, where: str) -> None:
    if tuple(sd["fc.weight"].shape) != (hidden, len(mo_ids) * hidden):
        raise SpeculatorsFormatError(f"{where}: fc.weight is {tuple(sd['fc.weight'].shape)}, expected "
                                     f"({hidden}, {len(mo_ids)} x {hidden}) for {layers}")


def check_eagle3_tensors(sd: dict, H: int, L: int, dv: int, mo_ids: list[int], where: str) -> None:
    required = {"fc.weight", "norm.weight", "lm_head.weight", "layers.0.hidden_norm.weight"}
    required |= {f"layers.{i}.{n}.weight" for i in range(L) for n in LAYER_TENSORS}
    check_tensors(sd, required, {"d2t"}, where)
    check_fc(sd, H, mo_ids, f"the capture layers {mo_ids}", where)
    if sd["layers.0.self_attn.q_proj.weight"].shape[1] != 2 * H:
        raise SpeculatorsFormatError(f"{where}: layers.0.self_attn.q_proj takes "
                                     f"{sd['layers.0.self_attn.q_proj.weight'].shape[1]} inputs, expected 2 x {H}")
    if sd["lm_head.weight"].shape[0] != dv:
        raise SpeculatorsFormatError(f"{where}: lm_head has {sd['lm_head.weight'].shape[0]} rows, draft_vocab_size {dv}")


def check_dflash_tensors(sd: dict, L: int, where: str) -> None:
    required = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    required |= {f"layers.{i}.{n}.weight" for i in range(L)
                 for n in (*LAYER_TENSORS, "self_attn.q_norm", "self_attn.k_norm")}
    check_tensors(sd, required, set(), where)


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


def vocab_map(sd: dict, dv: int, V: int, where: str) -> dict:
    """`d2t` (int64) and `t2d` (bool over the target vocabulary) for a reduced draft vocabulary; {} for a full one."""
    import torch

    if dv >= V:
        if "d2t" in sd and bool((sd["d2t"] != 0).any()):
            raise SpeculatorsFormatError(f"{where}: a non-zero d2t with draft_vocab_size == vocab_size")
        return {}
    if "d2t" not in sd:
        raise SpeculatorsFormatError(f"{where}: draft_vocab_size {dv} < vocab_size {V} but there is no d2t: "
                                     "draft ids cannot be mapped to target ids")
    d2t = sd["d2t"].to(torch.int64).contiguous()
    if tuple(d2t.shape) != (dv,):
        raise SpeculatorsFormatError(f"{where}: d2t has shape {tuple(d2t.shape)}, expected ({dv},)")
    target_ids = torch.arange(dv) + d2t
    if int(target_ids.min()) < 0 or int(target_ids.max()) >= V or target_ids.unique().numel() != dv:
        raise SpeculatorsFormatError(f"{where}: d2t does not map the {dv} draft ids to distinct target ids in [0, {V})")
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[target_ids] = True
    return {"d2t": d2t, "t2d": t2d}


def save(out_dir: Path, tensors: dict, doc: dict) -> None:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    (out_dir / WEIGHTS_FILE).chmod(0o644)      # safetensors writes 0600: a container user other than ours must read it
    (out_dir / "config.json").write_text(json.dumps(doc, indent=2) + "\n")
