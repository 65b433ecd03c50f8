"""Synthetic upstream artifacts laid out as the stages write them (docs/architecture.md contracts), and one stage
module run on them: the build, export, tune, serving and cost-model tests share these."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.device import ResolvedDevice
from pipeline.stage import Artifact, StageContext
from runtime import hf_config
from runtime.algorithms.schedule import DraftSchedule

from support import real_config

H = 8   # hidden size of the synthetic target and draft

# a target.json as the target stage writes it, for Llama-3.1-8B
LLAMA_8B = dict(architecture="LlamaForCausalLM", num_layers=32, hidden_size=4096, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, intermediate_size=14336, vocab_size=128256,
                max_position_embeddings=131072, dtype="bfloat16")


def target_json(model_dir: Path, **fields) -> dict:
    """A target.json with the fields its contract requires (pipeline/artifacts/target.py), from the model's
    config.json, plus `fields`."""
    c = json.loads((Path(model_dir) / "config.json").read_text())
    return {"architecture": c["architectures"][0], "num_layers": c["num_hidden_layers"], "hidden_size": c["hidden_size"],
            "vocab_size": c["vocab_size"], "dtype": "bfloat16", **fields}


def eagle3(t: dict, draft_vocab: int | None = None) -> tuple[dict, dict]:
    draft = {"algorithm": "eagle3", "num_layers": 1, "aux_layer_ids": [1, t["num_layers"] // 2 - 1, t["num_layers"] - 4],
             "vocab_size": t["vocab_size"], "draft_vocab_size": draft_vocab or t["vocab_size"], "has_d2t": bool(draft_vocab),
             "trained_draft_len": 6, "max_position_embeddings": t["max_position_embeddings"]}
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": t["hidden_size"],
           "num_attention_heads": t["num_attention_heads"], "num_key_value_heads": t["num_key_value_heads"],
           "head_dim": t["head_dim"], "intermediate_size": t["intermediate_size"], "num_hidden_layers": 1,
           "vocab_size": t["vocab_size"], "draft_vocab_size": draft["draft_vocab_size"]}
    return draft, cfg


def rope_cfg(theta: float, form: str) -> dict:
    """RoPE fields as each writer leaves them: transformers 5 (`rope_parameters` only), ModelOpt's EAGLE-3 export
    (`rope_theta` + a default-type `rope_scaling`), or specpipe's normalized form."""
    if form == "transformers5":
        return {"rope_parameters": {"rope_type": "default", "rope_theta": theta}}
    if form == "modelopt":
        return {"rope_theta": theta, "rope_scaling": {"rope_type": "default", "rope_theta": theta}}
    return {k: v for k, v in hf_config.normalize({"rope_theta": theta}).items()}


def write_acceptance(arts: Path) -> None:
    """A synthetic validate artifact (build writes the draft's speculation_profile.json from it): 4 steps at k=4
    accepting 0, 1, 2 and 4 draft tokens, in both domains."""
    st = {"acceptance_length": 2.75, "steps": 4, "accepted_per_step": [1, 1, 1, 0, 1], "per_position": [0.75, 2 / 3, 0.5, 1.0]}
    (arts / "validate").mkdir(parents=True, exist_ok=True)
    (arts / "validate" / "acceptance.json").write_text(json.dumps({
        "runtime": "reference", "max_draft_len": 4, "temperature": 0.0, "gates": {"passed": True, "rows": []},
        "domains": {d: {"fp8": st} for d in ("code", "prose")}, "overall": {"fp8": {**st, "steps": 8,
                                                                                   "accepted_per_step": [2, 2, 2, 0, 2]}}}))


def write_tuning(arts: Path, runs, *, version="1.2.1", mode="one_model", max_batch=16, graphs=None,
                 max_num_tokens=2048) -> None:
    (arts / "tune").mkdir(parents=True, exist_ok=True)
    sched = DraftSchedule.from_json({"runs": runs})
    (arts / "tune" / "tuning.json").write_text(json.dumps({
        "deployment": {"trtllm_version": version, "mode": mode, "note": "synthetic tuning for a test"},
        "speculation": sched.speculates(max_batch), "max_draft_len": sched.max_draft_len(max_batch),
        "draft_schedule": sched.to_json(max_batch), "max_batch_size": max_batch, "max_num_tokens": max_num_tokens,
        "cuda_graph_batch_sizes": graphs or [1, 2, 4, 8, 16]}))


@dataclass(frozen=True)
class Upstream:
    """What the synthetic upstream artifacts hold: the target's layers and vocabulary, the draft's vocabulary (None:
    the target's, no lm_head), d2t, capture layers (None: [1, 3, 5]) and decoder layers, whether the target is FP8 and
    with which quant_algo, the RoPE theta and how each config states it, the algorithm, and tune's schedule runs
    (None: a default for the version and mode) for TensorRT-LLM `version` in `mode`."""

    layers: int = 8
    vocab: int = 512
    draft_vocab: int | None = 256
    d2t: bool = True
    aux: list[int] | None = None
    fp8: bool = True
    algorithm: str = "eagle3"
    quant_algo: str = "FP8"
    theta: float = 1e5
    target_rope: str = "normalized"
    draft_rope: str = "normalized"
    draft_layers: int = 1
    runs: list | None = None
    version: str = "1.2.1"
    mode: str = "one_model"
    positions: int = 2048          # max_position_embeddings of target and draft (ModelOpt copies the target's)
    max_num_tokens: int = 2048     # tune's


def write_checkpoints(root: Path, up: Upstream = Upstream()) -> dict:
    """Synthetic upstream artifacts laid out as the stages write them (docs/architecture.md contracts)."""
    from safetensors.numpy import save_file

    arts = root / "artifacts"
    src = arts / "target" / "model"                      # the model the target stage prepared
    src.mkdir(parents=True)
    (src / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": up.layers,
                                                 "hidden_size": H, **rope_cfg(up.theta, "transformers5")}))
    tgt = arts / "quantize" / "target_fp8"
    tgt.mkdir(parents=True)
    (tgt / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": up.layers,
                                                 "hidden_size": H, "vocab_size": up.vocab,
                                                 "max_position_embeddings": up.positions, **rope_cfg(up.theta, up.target_rope)}))
    if up.fp8:
        (tgt / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": {
            "quant_algo": up.quant_algo, "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}}))
    draft = arts / "train_draft" / "draft"
    draft.mkdir(parents=True)
    aux = up.aux if up.aux is not None else [1, 3, 5]
    dcfg = {"architectures": ["LlamaForCausalLMEagle3"], "vocab_size": up.vocab, "max_position_embeddings": up.positions,
            "hidden_size": H, "num_hidden_layers": up.draft_layers,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux}, **rope_cfg(10000.0, up.draft_rope)}
    tensors = {"fc.weight": np.zeros((H, len(set(aux)) * H), np.float32), "norm.weight": np.ones(H, np.float32)}
    for i in range(up.draft_layers):   # ModelOpt 0.47's names (modelopt/torch/export/plugins/hf_spec_export.py)
        tensors[f"layers.{i}.self_attn.q_proj.weight"] = np.full((H, 2 * H if i == 0 else H), i + 1, np.float32)
        tensors[f"layers.{i}.input_layernorm.weight"] = np.ones(H, np.float32)
    tensors["layers.0.hidden_norm.weight"] = np.arange(H, dtype=np.float32)
    if up.draft_vocab is not None:
        dcfg["draft_vocab_size"] = up.draft_vocab
        tensors["lm_head.weight"] = np.zeros((up.draft_vocab, H), np.float32)
        if up.d2t:
            tensors["d2t"] = np.zeros((up.draft_vocab,), np.int64)
    if up.algorithm == "dflash":   # ModelOpt's DFlash export: no lm_head/embeddings, block + dflash_config
        dcfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 8, "num_target_layers": up.layers,
                "max_position_embeddings": up.positions, "dflash_config": {"mask_token_id": 2, "target_layer_ids": [1, 5]},
                **rope_cfg(up.theta, up.draft_rope)}
        tensors = {"fc.weight": np.zeros((H, 2 * H), np.float32),
                   "layers.0.self_attn.q_proj.weight": np.zeros((H, H), np.float32)}
    (draft / "config.json").write_text(json.dumps(dcfg))
    (draft / "tokenizer_config.json").write_text("{}")
    save_file(tensors, str(draft / "model.safetensors"))
    (arts / "quantize" / "quantize.json").write_text(json.dumps({
        "format": "fp8", "kv_cache": "fp8", "target_dir": "quantize/target_fp8", "draft_dir": "train_draft/draft",
        "draft_format": "bf16"}))
    (arts / "train_draft" / "draft.json").write_text(json.dumps({
        "algorithm": up.algorithm, "num_layers": up.draft_layers, "aux_layer_ids": aux if up.algorithm == "eagle3" else None,
        "block_size": 8 if up.algorithm == "dflash" else None, "vocab_size": up.vocab,
        "draft_vocab_size": up.draft_vocab or up.vocab, "has_d2t": up.d2t, "trained_draft_len": 3,
        "max_position_embeddings": up.positions}))
    write_acceptance(arts)
    write_tuning(arts, up.runs or ([[1, 16, 4]] if up.mode == "one_model" and up.version.startswith("1.2") else
                                   [[1, 4, 4], [5, 8, 2], [9, 16, 1 if up.version.startswith("1.3") else 0]]),
                 version=up.version, mode=up.mode, max_num_tokens=up.max_num_tokens)
    ev = arts / "data" / "eval"
    ev.mkdir(parents=True)
    for dom in ("code", "prose"):
        ev.joinpath(f"{dom}.jsonl").write_text("".join(json.dumps({"id": f"{dom}-{i}", "prompt": f"{dom} prompt {i}",
                                                                  "prompt_ids": [1, 2, 3 + i], "reference": None}) + "\n"
                                                       for i in range(3)))
    return {"arts": arts, "target": tgt, "draft": draft, "aux": aux}


def run_stage(root: Path, module, section) -> Path:
    """Run a stage module on the artifacts under root/artifacts and move its output into place."""
    arts = root / "artifacts"
    out = root / ".tmp" / module.NAME
    out.mkdir(parents=True)
    inputs = {n: Artifact(n, arts / n, {"fingerprint": n, "metrics": {}}) for n in module.CONSUMES}
    ctx = StageContext(name=module.NAME, config=real_config(**{module.NAME: section}),
                       section=section, out_dir=out, scratch_dir=root / "scratch", inputs=inputs, workdir=root,
                       fingerprint="x", log=logging.getLogger(f"test.{module.NAME}"),
                       device=ResolvedDevice("cpu", "cpu"))
    module.run(ctx)
    out.rename(arts / module.NAME)
    return arts / module.NAME


def build_context(root: Path, section, tp: int = 1) -> StageContext:
    """The build stage's context on the artifacts under root/artifacts, `section` its config, TP `tp`."""
    from stages import build

    arts = root / "artifacts"
    out = root / ".tmp" / "build"
    out.mkdir(parents=True)
    inputs = {n: Artifact(n, arts / n, {"fingerprint": n, "metrics": {}}) for n in build.CONSUMES}
    cfg = real_config(f"hardware.tensor_parallel_size={tp}", build=section)
    return StageContext(name="build", config=cfg, section=section, out_dir=out, scratch_dir=root / "scratch",
                        inputs=inputs, workdir=root, fingerprint="x", log=logging.getLogger("test.build"),
                        device=ResolvedDevice("cpu", "cpu"))


def shipped_build(root: Path, cfg_file: Path, positions: int, **over) -> tuple[dict, dict]:
    """Run the build stage with `cfg_file`'s build section on synthetic checkpoints covering `positions` tokens, tune's
    max_num_tokens computed from its tune section as tune computes it: (llm_api_options.yaml, deployment.json)."""
    import yaml

    from pipeline.config import load_config
    from runtime.cost import tuning
    from stages import build

    cfg = load_config(cfg_file, [])
    algo = cfg.train_draft.algorithm.kind
    version = cfg.build.trtllm_version
    mnt = tuning.max_num_tokens(16, 4, cfg.tune.min_num_tokens)
    write_checkpoints(root, Upstream(algorithm=algo, version=version, positions=positions, max_num_tokens=mnt,
                                     mode=cfg.build.eagle3_mode if algo == "eagle3" else "one_model"))
    section = cfg.build.model_copy(update={"load": "never", **over})
    ctx = build_context(root, section)
    build.run(ctx)
    dep = ctx.out_dir / "deployment"
    return yaml.safe_load((dep / "llm_api_options.yaml").read_text()), json.loads((ctx.out_dir / "deployment.json").read_text())


def serves_up_to_max_seq_len(root: Path, cfg_file: Path) -> None:
    """ModelOpt copies the target's max_position_embeddings into the draft, so max_seq_len is the model's context
    (131,072 for Llama-3.x) while tune's max_num_tokens stays near 8,192: every prompt up to max_seq_len - 1 must
    pass TensorRT-LLM's admission rule, which the options without enable_chunked_prefill would fail."""
    from runtime.trtllm import checks, schema

    opts, doc = shipped_build(root, cfg_file, 131072)
    assert opts["max_seq_len"] == 131072 and opts["max_num_tokens"] < 131071
    assert checks.prompt_rejection(opts, opts["max_seq_len"] - 1) is None
    assert opts["enable_chunked_prefill"] is True and doc["enable_chunked_prefill"] is True
    assert schema.unknown_keys(opts, doc["trtllm_version"]) == []
    assert {c["name"]: c["ok"] for c in doc["checks"]}["long_prompts"] is True
    without = {k: v for k, v in opts.items() if k != "enable_chunked_prefill"}    # what ab12171 wrote
    assert "should not exceed max_num_tokens" in checks.prompt_rejection(without, opts["max_seq_len"] - 1)


def needs_prepared_inputs(cfg_file: Path) -> bool:
    """A shipped config that reads the real model's prepared inputs (bench/real_model/prepare.sh), which a fresh
    checkout lacks: it loads only where they are (the `real_model` fixture)."""
    return "bench/real_model/prepared/" in Path(cfg_file).read_text()


def gate(root: Path, passed: bool) -> None:
    write_acceptance(root / "artifacts")       # validate's measurement, with the gate outcome `passed`
    f = root / "artifacts" / "validate" / "acceptance.json"
    doc = json.loads(f.read_text())
    doc["gates"] = {"passed": passed, "rows": [{"domain": "code", "metric": "acceptance_length",
                                                "measured": 1.4 if not passed else 2.6, "required": 2.0, "passed": passed}]}
    f.write_text(json.dumps(doc))


