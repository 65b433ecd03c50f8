"""runtime/algorithms/: the one place that says what a valid draft is. A draft exported by ModelOpt 0.47 itself
passes; each kind of defect is reported by the algorithm's `check_export` and, in the same words, by the callers
that validate exports (training's draft_checks, the engine's loader, quantize's EAGLE-3 FP8, build's TensorRT-LLM
checks, the speculators conversion): they share it.

Upstream truth encoded here (named in runtime/algorithms/eagle3.py): `norm.weight` is required, whatever
eagle_config.use_last_layernorm says: ModelOpt 0.47.0 modelopt/torch/export/plugins/hf_spec_export.py
(LLAMA_EAGLE_SINGLE_LAYER "required" holds "norm"; EagleExporter._check_valid_sd asserts it) and NVIDIA/TensorRT-LLM
tensorrt_llm/_torch/models/modeling_speculative.py at 00679c66c3e38f6d2651ad0a5bef0f94d862e36c (Eagle3DraftModel
builds `self.norm` unconditionally; `d2t` an int32 Parameter of (draft_vocab_size,) iff draft_vocab_size != vocab_size).
Cheap: a 4-layer target built in memory, converted and exported by ModelOpt without training."""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

from support import REPO

H, LAYERS, VOCAB, DV = 32, 4, 128, 64
AUX = [0, 1, 3]


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict:
    """A tiny target (saved) and its EAGLE-3 (reduced vocabulary + d2t) and DFlash drafts as ModelOpt exports them."""
    import modelopt.torch.speculative as mtsp
    from modelopt.torch.export import export_speculative_decoding
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("algorithms")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=64, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(root / "target")
    m = LlamaForCausalLM.from_pretrained(root / "target", dtype=torch.float32)
    ec = copy.deepcopy(mtsp.EAGLE3_DEFAULT_CFG["config"])
    ec["eagle_architecture_config"].update({"num_hidden_layers": 1, "intermediate_size": 64, "num_attention_heads": 4,
                                            "num_key_value_heads": 2, "head_dim": 8, "draft_vocab_size": DV,
                                            "eagle_aux_hidden_state_layer_ids": AUX})
    ec["eagle_use_torch_compile"] = False
    mtsp.convert(m, [("eagle", ec)])
    m.eagle_module.d2t.copy_(torch.arange(0, 2 * DV, 2) - torch.arange(DV))   # draft id i -> target id 2i
    export_speculative_decoding(m, export_dir=root / "eagle3")
    m = LlamaForCausalLM.from_pretrained(root / "target", dtype=torch.float32)
    dc = copy.deepcopy(mtsp.DFLASH_DEFAULT_CFG["config"])
    dc.update({"dflash_block_size": 4, "dflash_mask_token_id": VOCAB - 1, "dflash_use_torch_compile": False,
               "dflash_architecture_config": {"num_hidden_layers": 2, "target_layer_ids": [1, 2], "intermediate_size": 64,
                                              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}})
    mtsp.convert(m, [("dflash", dc)])
    export_speculative_decoding(m, export_dir=root / "dflash")
    return {"root": root, "target": root / "target", "eagle3": root / "eagle3", "dflash": root / "dflash"}


def _broken(src: Path, dst: Path, cfg=None, sd=None) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if cfg:
        c = json.loads((dst / "config.json").read_text())
        cfg(c)
        (dst / "config.json").write_text(json.dumps(c))
    if sd:
        t = load_file(str(dst / "model.safetensors"))
        sd(t)
        save_file(t, str(dst / "model.safetensors"))
    return dst


def _pop(*names):
    return lambda t: [t.pop(n) for n in names]


def _set(name, value):
    return lambda t: t.__setitem__(name, value() if callable(value) else value)


# ------------------------------------------------------------------------------------------------ the callers


def _by_training(d: Path, algo: str) -> str:
    from runtime.training.draft_checks import Expect, check_draft

    e = (Expect("eagle3", 1, H, VOCAB, AUX, 16, draft_vocab_size=DV) if algo == "eagle3" else
         Expect("dflash", 2, H, VOCAB, [1, 2], 16, block_size=4, mask_token_id=VOCAB - 1))
    return " | ".join(c.message for c in check_draft(d, e) if not c.passed)


def _by_engine(d: Path, algo: str) -> str:
    from runtime.engine.drafts import DraftFormatError, load_draft

    with pytest.raises(DraftFormatError) as e:
        load_draft(d)
    return str(e.value)


def _by_speculators(d: Path, algo: str, target: Path) -> str:
    from runtime.vllm import speculators_format as S

    with pytest.raises(S.SpeculatorsFormatError) as e:
        S.write_speculators_draft(d, d.parent / f"{d.name}-spec", target_dir=target, speculative_tokens=2)
    return str(e.value)


def _by_quantize(d: Path, algo: str, target: Path) -> str:
    from runtime.quant.eagle_draft import DraftRebuildError, quantize_eagle_checkpoint

    with pytest.raises(DraftRebuildError) as e:
        quantize_eagle_checkpoint(target, d, d.parent / f"{d.name}-fp8", [], [])
    return str(e.value)


def _by_trtllm(d: Path, algo: str) -> str:
    """build's TensorRT-LLM checks: the draft's vocabulary (d2t) and fc against the capture layers."""
    from runtime.trtllm.checks import _draft_tensors, _draft_vocab, _eagle3_fc_check

    cfg = json.loads((d / "config.json").read_text())
    said = []
    _eagle3_fc_check(lambda name, ok, msg: said.append((ok, msg)), d, cfg, _draft_tensors(d))
    said.append(_draft_vocab(d, cfg))
    assert not all(ok for ok, _ in said), said
    return " | ".join(msg for ok, msg in said if not ok)


# defect -> (algorithm, config edit, tensors edit, the check that reports it, the callers that must say the same)
EAGLE = ("training", "engine", "speculators", "quantize")
DEFECTS = {
    "norm_missing": ("eagle3", None, _pop("norm.weight"), "required_tensors", EAGLE),
    "norm_missing_without_last_layernorm": ("eagle3", lambda c: c["eagle_config"].update(use_last_layernorm=False),
                                            _pop("norm.weight"), "required_tensors", ("training", "engine", "quantize")),
    "unexpected_tensor": ("eagle3", None, _set("embed_tokens.weight", lambda: torch.zeros(VOCAB, H)), "unexpected_tensors",
                          EAGLE),
    "d2t_missing": ("eagle3", None, _pop("d2t"), "d2t", (*EAGLE, "trtllm")),
    "d2t_float": ("eagle3", None, _set("d2t", lambda: torch.zeros(DV)), "d2t", (*EAGLE, "trtllm")),
    "d2t_shape": ("eagle3", None, _set("d2t", lambda: torch.zeros(DV - 1, dtype=torch.int64)), "d2t", (*EAGLE, "trtllm")),
    "d2t_duplicate": ("eagle3", None, _set("d2t", lambda: -torch.arange(DV)), "d2t", (*EAGLE, "trtllm")),
    "d2t_outside": ("eagle3", None, _set("d2t", lambda: torch.full((DV,), VOCAB, dtype=torch.int64)), "d2t",
                    (*EAGLE, "trtllm")),
    "fc_vs_capture_layers": ("eagle3", None, _set("fc.weight", lambda: torch.zeros(H, 2 * H)), "fc_shape",
                             ("training", "engine", "speculators", "quantize", "trtllm")),
    "config_key_missing": ("eagle3", lambda c: c.pop("hidden_size"), None, "config_keys", ("training", "engine")),
    "draft_vocab_size_missing": ("eagle3", lambda c: c.pop("draft_vocab_size"), None, "draft_vocab_size",
                                 ("training", "speculators", "quantize")),
    "eagle_config_not_eagle3": ("eagle3", lambda c: c["eagle_config"].update(use_aux_hidden_state=False), None,
                                "eagle_config", ("training", "engine", "quantize")),
    "dflash_q_norm_missing": ("dflash", None, _pop("layers.1.self_attn.q_norm.weight"), "required_tensors",
                              ("training", "engine", "speculators")),
    "dflash_lm_head": ("dflash", None, _set("lm_head.weight", lambda: torch.zeros(VOCAB, H)), "unexpected_tensors",
                       ("training", "engine", "speculators")),
    "dflash_fc_vs_target_layers": ("dflash", lambda c: c["dflash_config"].update(target_layer_ids=[1]), None, "fc_shape",
                                   ("engine", "speculators")),
    "dflash_mask_token_missing": ("dflash", lambda c: c["dflash_config"].pop("mask_token_id"), None, "config_keys",
                                  ("training", "engine")),
    "dflash_block_size": ("dflash", lambda c: c.update(block_size=1), None, "block_size", ("training", "engine")),
}


def test_modelopt_exports_are_valid(exports):
    from runtime.algorithms import registry
    from runtime.algorithms.export import TargetShape

    shape = TargetShape(H, VOCAB, LAYERS)
    for algo in ("eagle3", "dflash"):
        assert registry.check_export(exports[algo], target=shape) == [], algo
        assert not _by_training(exports[algo], algo)
    assert registry.algorithm_of(json.loads((exports["eagle3"] / "config.json").read_text())) == "eagle3"
    # the Algorithm's parse of what ModelOpt wrote: the capture layers it was converted with
    assert registry.get("eagle3").parse(json.loads((exports["eagle3"] / "config.json").read_text())).capture_layers \
        == tuple(AUX)
    dcfg = registry.get("dflash").parse(json.loads((exports["dflash"] / "config.json").read_text()))
    assert (dcfg.capture_layers, dcfg.block_size, dcfg.max_draft_len) == ((1, 2), 4, 3)


@pytest.mark.parametrize("defect", sorted(DEFECTS))
def test_each_defect_is_reported_by_check_export_and_its_callers_in_the_same_words(exports, tmp_path, defect):
    from runtime.algorithms import registry

    algo, cfg, sd, check, callers = DEFECTS[defect]
    d = _broken(exports[algo], tmp_path / defect, cfg, sd)
    probs = registry.check_export(d)
    assert [p.check for p in probs] == [check], probs
    words = probs[0].message
    assert str(d) in words                      # it names the export
    said = {"training": lambda: _by_training(d, algo), "engine": lambda: _by_engine(d, algo),
            "speculators": lambda: _by_speculators(d, algo, exports["target"]),
            "quantize": lambda: _by_quantize(d, algo, exports["target"]), "trtllm": lambda: _by_trtllm(d, algo)}
    assert len(callers) >= 2
    for c in callers:
        assert words in said[c](), c


def test_the_engine_tolerates_what_tensorrt_llm_tolerates(exports, tmp_path):
    """Not strict, a missing d2t loads (TensorRT-LLM would read draft ids as target ids); a config.json without
    draft_vocab_size is the full vocabulary (TensorRT-LLM's _ensure_draft_vocab_size) and then fails on lm_head."""
    from runtime.engine.drafts import DraftFormatError, load_draft

    d = _broken(exports["eagle3"], tmp_path / "nod2t", sd=_pop("d2t"))
    assert load_draft(d, strict=False).d2t is None
    d = _broken(exports["eagle3"], tmp_path / "nodv", cfg=lambda c: c.pop("draft_vocab_size"))
    with pytest.raises(DraftFormatError, match=f"lm_head.weight has {DV} rows but draft_vocab_size is {VOCAB}"):
        load_draft(d)


def test_pairing_with_the_target(exports):
    from runtime.algorithms import registry
    from runtime.algorithms.export import TargetShape

    got = registry.check_export(exports["eagle3"], target=TargetShape(H, VOCAB, 2))
    assert [p.check for p in got] == ["pairing"] and "aux layer ids [3] are outside the target's 2 layers" in got[0].message
    got = registry.check_export(exports["dflash"], target=TargetShape(H + 1, VOCAB, LAYERS))
    assert [p.check for p in got] == ["pairing"] and "hidden_size" in got[0].message


def test_dflash_cap_and_ngram_settings():
    from runtime.algorithms import dflash, ngram
    from runtime.trtllm.ngram_deployment import ngram_speculative_config

    assert dflash.max_draft_len(4) == 3
    with pytest.raises(ValueError, match="drafts nothing"):
        dflash.max_draft_len(1)
    assert ngram.check_export({"k": 3, "min_n": 1, "max_n": 4}) == []
    probs = ngram.check_export({"k": 0, "min_n": 1, "max_n": 4}, "NGram speculative_config")
    assert [p.check for p in probs] == ["k"]
    with pytest.raises(ValueError) as e:
        ngram_speculative_config(0, 4)
    assert probs[0].message in str(e.value)


def test_algorithms_import_no_engine_and_no_serving_package():
    import ast

    root = REPO / "runtime" / "algorithms"
    for f in sorted(root.glob("*.py")):
        mods = {n.module for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.ImportFrom) and n.module}
        mods |= {a.name for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.Import) for a in n.names}
        bad = sorted(m for m in mods if m.startswith(("runtime.engine", "runtime.trtllm", "runtime.vllm",
                                                                     "runtime.training", "runtime.quant")))
        assert not bad, f"{f.name} imports {bad}: the engine, TensorRT-LLM and vLLM packages import runtime/algorithms"
