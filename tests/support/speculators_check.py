"""Runs INSIDE the speculators venv (speculators 0.9.0, its own numpy/torch), never in the project's venv.

    python tests/support/speculators_check.py MANIFEST.json

MANIFEST: {"cases": [{"name", "spec_dir", "loading", "runs": [{"inputs", "output"}, ...]}]} (inputs and
outputs are safetensors files, loading a JSON file). For each case it loads `spec_dir` with the speculators
library's own classes (`SpeculatorModel.from_pretrained`, which resolves Eagle3DraftModel / DFlashDraftModel from
`speculators_model_type` and loads the verifier-owned weights from `speculators_config.verifier.name_or_path`),
runs the library's forward on the given target hidden states, and writes what its draft proposes:

EAGLE-3 inputs: `hidden` [T, n*H] (the target's aux hidden states at positions 0..T-1), `input_ids` [T] (the token
after each position, ModelOpt's/vLLM's pairing), scalar `ttt_steps` k. `Eagle3DraftModel.forward(ttt_steps=k)`
is the library's test-time-training forward: step 0 drafts at every position from the target states; step j
feeds the step j-1 outputs with the tokens `input_ids[i + j]` (teacher forcing). Outputs: `argmax` [k, T] (draft
vocabulary, what forward returns), `target_ids` [k, T] (mapped with the loaded `d2t`), `logits` [k, T, Vd].

DFlash inputs: `hidden` [T, n*H], `input_ids` [T] (the token at each position), `anchors` [A] (block starts p >= 1:
block [input_ids[p], mask, ...] at positions p.., context = positions < p). `DFlashDraftModel._backbone_forward`
(what `forward` runs before its loss) gives the block logits. Outputs: `argmax` [A, block_size - 1] and `logits`.

Every case also reports the weights the model has that the checkpoint did not set and the checkpoint's tensors the
model has no place for (the case's `loading` file), so a misnamed tensor cannot hide behind a random init.
Positions are passed explicitly (0-based, the positions vLLM and specpipe's runtime use).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

# verifier-owned weights speculators 0.9.0 reloads from the verifier on purpose (model.py DraftVocabMixin,
# eagle3/core.py and dflash/core.py _keys_to_ignore_on_load_missing), plus lm_head for full-vocabulary DFlash
VERIFIER_OWNED = {"embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight"}


def load(spec_dir: str):
    from speculators import SpeculatorModel, SpeculatorModelConfig

    cfg = SpeculatorModelConfig.from_pretrained(spec_dir)
    cfg.transformer_layer_config._attn_implementation = "eager"   # flex attention needs torch.compile/CUDA
    model = SpeculatorModel.from_pretrained(spec_dir, config=cfg, dtype=torch.float32)   # exact upcast, no rounding
    model = model.eval()
    with safe_open(str(Path(spec_dir) / "model.safetensors"), "pt") as f:
        stored = set(f.keys())
    have = set(model.state_dict())
    owned = set(VERIFIER_OWNED)
    if cfg.speculators_model_type == "dflash" and not model.use_draft_vocab:
        owned.add("lm_head.weight")
    sd = model.state_dict()
    info = {"class": type(model).__name__, "not_in_checkpoint": sorted(have - stored - owned),
            "not_in_model": sorted(stored - have),
            "nan_parameters": sorted(k for k, v in sd.items() if v.is_floating_point() and v.isnan().any())}
    # verifier-owned weights must be the verifier's: speculators 0.9.0 leaves a missing embed_tokens uninitialized
    # (not NaN) under transformers 5.19, so check values, not presence
    verifier = cfg.speculators_config.verifier.name_or_path
    embed = verifier_tensor(verifier, "embed_tokens.weight")
    expect = {"embed_tokens.weight": embed}
    if "lm_head.weight" in owned:
        expect["lm_head.weight"] = verifier_tensor(verifier, "lm_head.weight", default=embed)
    info["differs_from_verifier"] = sorted(k for k, v in expect.items() if not torch.equal(sd[k], v.float()))
    return model, cfg, info


def verifier_tensor(path: str, suffix: str, default=None):
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            names = sorted((k for k in h.keys() if k == suffix or k.endswith("." + suffix)), key=len)
            if names:
                return h.get_tensor(names[0])
    if default is None:
        raise KeyError(f"{path}: no *{suffix}")
    return default


@torch.no_grad()
def eagle3(model, x: dict) -> dict:
    h, ids, k = x["hidden"].float()[None], x["input_ids"].long()[None], int(x["ttt_steps"])
    T = h.shape[1]
    logits: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: logits.append(o[0].detach().clone()))
    try:
        drafts = model(hidden_states=h, input_ids=ids, document_ids=torch.zeros(1, T, dtype=torch.long),
                       position_ids=torch.arange(T)[None], ttt_steps=k)
    finally:
        hook.remove()
    argmax = torch.cat(drafts, 0)                                   # [k, T] draft vocabulary
    target = argmax if model.d2t is None else argmax + model.d2t[argmax]
    return {"argmax": argmax.clone(), "target_ids": target.clone(), "logits": torch.stack(logits).contiguous()}


@torch.no_grad()
def dflash(model, x: dict) -> dict:
    bs = model.block_size
    h, ids, anchors = x["hidden"].float(), x["input_ids"].long(), x["anchors"].long()
    T = h.shape[0]
    pad = bs                                                          # select_anchors never picks the last block_size
    hidden = torch.cat([h, h.new_zeros(pad, h.shape[1])])[None]
    input_ids = torch.cat([ids, ids.new_full((pad,), model.mask_token_id)])[None]
    loss_mask = torch.zeros(1, T + pad, dtype=torch.long)
    loss_mask[0, anchors] = 1                                         # every anchor selected (max_anchors = their count)
    out = model._backbone_forward(hidden, input_ids, loss_mask, torch.zeros(1, T + pad, model.hidden_size),
                                  torch.zeros(1, T + pad, dtype=torch.long), torch.arange(T + pad)[None],
                                  max_anchors=int(anchors.numel()))
    _, logits, _, _, blocks = out
    got = blocks.view(-1, bs)[:, 0]
    if not torch.equal(got, anchors):
        raise RuntimeError(f"speculators chose anchors {got.tolist()}, asked for {anchors.tolist()}")
    logits = logits[0].view(anchors.numel(), bs, -1)[:, 1:]           # slot 0 is the anchor (sample_from_anchor false)
    return {"argmax": logits.argmax(-1).contiguous(), "logits": logits.contiguous()}


def main(manifest: str) -> int:
    from importlib.metadata import version

    cases = json.loads(Path(manifest).read_text())["cases"]
    for case in cases:
        model, cfg, info = load(case["spec_dir"])
        info.update(speculators=version("speculators"), torch=torch.__version__, name=case["name"],
                    model_type=cfg.speculators_model_type,
                    speculative_tokens=cfg.speculators_config.proposal_methods[0].speculative_tokens)
        Path(case["loading"]).write_text(json.dumps(info, indent=2))
        for run in case["runs"]:
            x = load_file(run["inputs"])
            res = eagle3(model, x) if cfg.speculators_model_type == "eagle3" else dflash(model, x)
            save_file(res, run["output"])
        print(f"{case['name']}: {info['class']}, {len(case['runs'])} runs, not in checkpoint "
              f"{info['not_in_checkpoint']}, not in model {info['not_in_model']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
