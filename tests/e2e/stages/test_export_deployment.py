"""Stage `export`: what every EAGLE-3 deployment must satisfy (TensorRT-LLM versions, defects 1-3, RoPE), read from the
committed files of the session's tiny pipeline (`tiny_run`) and of SmolLM2-135M-Instruct (`real_model`, prepared by
`bash bench/real_model/prepare.sh`), which puts this module in tests/e2e. The stage's other tests: test_export.py."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from runtime import hf_config
from runtime.trtllm import draft_weights
from stages import build, export

from support import triton_model_config as parse
from support.synthetic import gate, run_stage


def _assert_deployment_is_the_targeted_versions(arts: Path, version: str) -> dict:
    """What every EAGLE-3 deployment must satisfy, read from its committed files (defects 1-3 and RoPE)."""
    from runtime.trtllm import compat

    rel = compat.release(version)
    draft = json.loads((arts / "train_draft" / "draft.json").read_text())
    dep = json.loads((arts / "build" / "deployment.json").read_text())
    sc = yaml.safe_load((arts / "build" / "deployment" / "llm_api_options.yaml").read_text())["speculative_config"]
    tcfg = json.loads(Path(dep["target_dir"], "config.json").read_text())
    assert sc["eagle3_layers_to_capture"] == sorted(set(draft["aux_layer_ids"])) == dep["eagle3_layers_to_capture"]
    fc = draft_weights.safetensors_tensors(Path(dep["trtllm_draft_dir"]) / "model.safetensors")["fc.weight"]
    assert fc[1] == len(sc["eagle3_layers_to_capture"]) * tcfg["hidden_size"]
    names = draft_weights.safetensors_tensors(Path(dep["trtllm_draft_dir"]) / "model.safetensors")
    if rel.eagle3_draft_layer_prefix == "midlayer":
        assert not [n for n in names if n.startswith("layers.")] and any(n.startswith("midlayer.") for n in names)
    if version.startswith("1.2") and dep["mode"] == "one_model":
        assert "draft_len_schedule" not in sc and "max_concurrency" not in sc
    prod = parse(arts / "export" / "triton" / "tensorrt_llm" / "config.pbtxt")
    assert prod.model_transaction_policy.decoupled and prod.max_batch_size == 0
    for d in {dep["target_dir"], dep["draft_dir"], dep["trtllm_draft_dir"]}:
        cfg = json.loads(Path(d, "config.json").read_text())
        assert hf_config.problems(cfg, rel.hf_rope_form) == [], d
    return {"dep": dep, "sc": sc, "tcfg": tcfg}


def test_tiny_pipeline_deployment_is_the_targeted_versions(tiny_run):
    """The tiny pipeline end to end (configs/tiny_fp8_eagle3.yaml, TensorRT-LLM 1.2.1 one-model)."""
    from conftest import artifact_dir

    wd, r = tiny_run
    artifact_dir(wd, "export")
    got = _assert_deployment_is_the_targeted_versions(wd / "artifacts", "1.2.1")
    tgt = json.loads((wd / "artifacts" / "target" / "model" / "config.json").read_text())
    assert got["tcfg"]["rope_theta"] == hf_config.read(tgt).theta


@pytest.mark.slow
def test_real_model_deployment_is_the_targeted_versions(real_model, tmp_path):
    """SmolLM2-135M-Instruct: FP8 target exported through quantize's export_target (its RoPE hook), an EAGLE-3
    draft on 3 capture layers exported by ModelOpt 0.47 (untrained: only its format matters here) and normalized
    as train_draft does; build + export for 1.2.1 and 1.3.0rc27. Theta must stay 1e5 in the target."""
    import modelopt.torch.speculative as mtsp
    import torch
    from modelopt.torch.export import export_speculative_decoding
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from runtime.quant.export import export_target
    from runtime.quant.ptq import quantize_model
    from runtime.training.model import convert_config

    md = real_model["model_dir"]
    cfg = json.loads((md / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(md)
    src = tmp_path / "src"
    arts = src / "artifacts"
    (arts / "target" / "model").mkdir(parents=True)
    (arts / "target" / "model" / "config.json").write_text((md / "config.json").read_text())
    calib = [{"input_ids": torch.tensor(tok(t)["input_ids"])} for t in ("def add(a, b):", "The capital of France is")]
    tq = quantize_model(md, calib, kv_cache="fp8")
    export_target(tq, arts / "quantize" / "target_fp8", md, torch.bfloat16)
    del tq
    aux = [1, 14, 26]
    m = AutoModelForCausalLM.from_pretrained(md, dtype=torch.float32)
    job = {"algorithm": {"name": "eagle3", "draft_layers": 1, "intermediate_size": None, "aux_layer_ids": aux,
                         "draft_vocab_size": cfg["vocab_size"], "ttt_steps": 3, "loss_decay_factor": 0.9},
           "target": {k: cfg[k] for k in ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                          "vocab_size")}, "torch_compile": False, "export_rope_scaling": {}}
    mode, ccfg = convert_config(job, False)
    mtsp.convert(m, [(mode, ccfg)])
    ddir = arts / "train_draft" / "draft"
    export_speculative_decoding(m.to(torch.bfloat16), export_dir=str(ddir))
    del m
    exported = json.loads((ddir / "config.json").read_text())
    assert exported["rope_scaling"]["rope_type"] == "default"      # what ModelOpt 0.47 writes; 1.2 cannot read it
    hf_config.normalize_file(ddir / "config.json")                 # train_draft's hook
    (arts / "train_draft" / "draft.json").write_text(json.dumps({
        "algorithm": "eagle3", "num_layers": 1, "aux_layer_ids": aux, "vocab_size": cfg["vocab_size"],
        "draft_vocab_size": cfg["vocab_size"], "trained_draft_len": 3, "max_position_embeddings": 8192}))
    (arts / "quantize" / "quantize.json").write_text(json.dumps({"format": "fp8", "kv_cache": "fp8",
                                                                 "target_dir": "quantize/target_fp8",
                                                                 "draft_dir": "train_draft/draft", "draft_format": "bf16"}))
    (arts / "data" / "eval").mkdir(parents=True)
    line = {"id": "gsm8k-0", "prompt": "2 + 2 =", "prompt_ids": [1, 2]}
    (arts / "data" / "eval" / "gsm8k.jsonl").write_text(json.dumps(line) + "\n")
    tcfg = json.loads((arts / "quantize" / "target_fp8" / "config.json").read_text())
    assert tcfg["rope_theta"] == 1e5 and tcfg["rope_scaling"] is None and tcfg["rope_parameters"]["rope_theta"] == 1e5
    for version, runs in (("1.2.1", [[1, 64, 3]]), ("1.3.0rc27", [[1, 8, 3], [9, 64, 2]])):
        root = tmp_path / version

        shutil.copytree(src, root, copy_function=os.link)
        from support.synthetic import write_tuning

        write_tuning(root / "artifacts", runs, version=version, max_batch=64)
        gate(root, True)
        run_stage(root, build, build.Config(trtllm_version=version, max_seq_len=4096))
        run_stage(root, export, export.Config())
        got = _assert_deployment_is_the_targeted_versions(root / "artifacts", version)
        assert got["sc"]["eagle3_layers_to_capture"] == aux and got["tcfg"]["hidden_size"] == 576
        names = {c["name"]: c for c in got["dep"]["checks"]}
        assert "theta 100000" in names["target_rope"]["message"]
