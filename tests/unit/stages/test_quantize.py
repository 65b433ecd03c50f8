"""Stage `quantize`: the stage's `run` on tiny real artifacts (target, data parquet files, an EAGLE-3 draft exported
by ModelOpt), its format checks on broken checkpoints, its quality gate and its config.

The module fixture builds, once: a tiny Llama (hidden 64, 2 layers) with the project's BPE tokenizer, pretrained
for a few dozen steps on standard-library sources; `calib.parquet`/`heldout.parquet` cut from them; an EAGLE-3
draft converted, briefly trained and exported by ModelOpt. Then it runs `stages.quantize.run` with FP8 KV and an
FP8 draft."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pipeline.errors import StageError
from pipeline.stage import Artifact, StageContext
from runtime.engine import fp8
from runtime.quant import export as qexport
from runtime.quant import ptq
from runtime.quant.checks import check_checkpoint
from stages import quantize as Q

from conftest import stage_context
from support import real_config
from support.synthetic import target_json

SEQ = 64


def _tiny_target(root: Path) -> tuple[Path, list[list[int]]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from runtime.target.corpus import stdlib_corpus, train_tokenizer

    texts = [t for _, t in stdlib_corpus(400_000)]
    model_dir = root / "target" / "model"
    tok = train_tokenizer(texts, 512, model_dir)
    ids = []
    for t in texts:
        ids += tok(t)["input_ids"] + [tok.eos_token_id]
    data = torch.tensor(ids)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    cfg.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(60):
        starts = torch.randint(0, len(data) - SEQ - 1, (8,))
        x = torch.stack([data[s: s + SEQ] for s in starts])
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    model.to(torch.bfloat16).save_pretrained(model_dir)
    (root / "target" / "target.json").write_text(json.dumps(target_json(model_dir)))
    # samples cut from the end of the corpus for calibration / held-out
    tail = data[-40 * SEQ:]
    return model_dir, [tail[i * SEQ:(i + 1) * SEQ].tolist() for i in range(40)]


def _write_data(root: Path, samples: list[list[int]]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = root / "data"
    d.mkdir()
    # calibration samples of varying length (as the data stage writes them)
    calib = [r[: 24 + (i * 7) % 40] for i, r in enumerate(samples[:16])]
    for name, rows in (("calib", calib), ("heldout", samples[16:28])):
        pq.write_table(pa.Table.from_pylist([{"input_ids": r, "loss_mask": [1] * len(r), "domain": "code", "source": "t"}
                                             for r in rows]), str(d / f"{name}.parquet"))
    return d


def _eagle_draft(root: Path, model_dir: Path, samples) -> Path:
    import copy

    import modelopt.torch.speculative as mtsp
    from modelopt.torch.export import export_speculative_decoding
    from transformers import LlamaForCausalLM

    m = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = copy.deepcopy(mtsp.EAGLE3_DEFAULT_CFG["config"])
    cfg["eagle_architecture_config"].update({"num_hidden_layers": 1, "intermediate_size": 128, "num_attention_heads": 4,
                                             "num_key_value_heads": 2, "head_dim": 16})
    cfg["eagle_use_torch_compile"] = False
    mtsp.convert(m, [("eagle", cfg)])
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=3e-3)
    m.train()
    for i in range(10):
        x = torch.tensor(samples[i % 16])[None]
        m(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    d = root / "train_draft" / "draft"
    export_speculative_decoding(m.eval(), dtype=torch.bfloat16, export_dir=d)
    # train_draft stores bf16 (its export dtype); ModelOpt leaves the exported tensors in the training dtype
    qexport.cast_high_precision(d, lambda k, v: torch.bfloat16)
    qexport.copy_tokenizer(model_dir, d)
    return d


def _ctx(root: Path, out: str, **section) -> StageContext:
    sec = Q.Config(calib_samples=16, calib_seq_len=48, eval_samples=12, **section)
    out_dir = root / out
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir()
    inputs = {n: Artifact(n, root / n, {"fingerprint": n, "metrics": {}}) for n in ("target", "data", "train_draft")}
    return stage_context("quantize", sec, inputs=inputs, out_dir=out_dir, scratch_dir=root / "scratch", workdir=root,
                         overrides=("run.device=cpu",))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantize")
    model_dir, samples = _tiny_target(root)
    _write_data(root, samples)
    _eagle_draft(root, model_dir, samples)
    ctx = _ctx(root, "out", kv_cache="fp8", draft="fp8", exclude_modules=["model.layers.1.mlp.down_proj"],
               max_ppl_increase=0.5)
    metrics = Q.run(ctx)
    return SimpleNamespace(root=root, out=ctx.out_dir, metrics=metrics, model_dir=model_dir)


def test_stage_writes_the_artifact_contract(built):
    out = built.out
    meta = json.loads((out / "quantize.json").read_text())
    assert meta["format"] == "fp8" and meta["quant_algo"] == "FP8" and meta["kv_cache"] == "fp8"
    assert meta["target_dir"] == "quantize/target_fp8" and meta["draft_dir"] == "quantize/draft_fp8"
    assert meta["recipes_tried"] == ["fp8"] and meta["auto_excluded"] == []
    assert all(c["passed"] for c in meta["checks"]) and len(meta["checks"]) == 8
    t = out / "target_fp8"
    assert fp8.is_fp8_checkpoint(t) and fp8.is_fp8_checkpoint(out / "draft_fp8")
    assert (t / "tokenizer.json").exists() and (t / "tokenizer_config.json").exists()
    assert json.loads((t / "config.json").read_text())["dtype"] == "bfloat16"
    q = json.loads((out / "quality.json").read_text())
    for k in ("ppl_bf16", "ppl_fp8", "ppl_fakequant", "ppl_increase", "top1_agreement", "mean_kl", "eval_tokens",
              "export_vs_fakequant_kl", "noise_floor_kl", "layerwise_max_rel_err"):
        assert k in q and k in built.metrics or k == "eval_tokens"
    assert [r["format"] for r in q["recipes"]] == ["fp8"] and q["recipes"][0]["gate_passed"]
    json.dumps(built.metrics)  # JSON-able for status --json


def test_target_checkpoint_as_tensorrt_llm_expects(built):
    t = built.out / "target_fp8"
    q = json.loads((t / "hf_quant_config.json").read_text())["quantization"]
    assert q["quant_algo"] == "FP8" and q["kv_cache_quant_algo"] == "FP8"
    assert "model.layers.1.mlp.down_proj" in q["exclude_modules"] and "lm_head" in q["exclude_modules"]
    sd = fp8.read_safetensors(t)
    assert sd["model.layers.1.mlp.down_proj.weight"].dtype == torch.bfloat16        # excluded: high precision
    assert "model.layers.1.mlp.down_proj.input_scale" not in sd
    assert sd["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert len(fp8.fp8_linear_prefixes(sd)) == 13
    assert sd["lm_head.weight"].dtype == torch.bfloat16 and sd["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert sd["model.layers.0.self_attn.k_proj.k_scale"].dtype == torch.float32


def test_quality_measured_on_the_exported_checkpoint(built):
    m = built.metrics
    assert m["ppl_bf16"] > 1 and m["ppl_fp8"] > 1
    assert abs(m["ppl_increase"]) < 0.05          # FP8 per-tensor costs little, even on a tiny model
    assert 0.8 < m["top1_agreement"] <= 1 and 0 <= m["mean_kl"] < 0.05
    # The exported checkpoint run by runtime.engine.fp8 (TensorRT-LLM's arithmetic) reproduces ModelOpt's fake-quant model
    # (aligned with the deployment): module by module every activation code is the same away from exact rounding
    # ties and the GEMMs agree to float rounding; end to end the two agree as well as the FP8 model agrees with
    # itself under a 1e-6 input perturbation (the noise floor), within 2x on this small sample.
    q = json.loads((built.out / "quality.json").read_text())
    assert q["modulewise_checked"] == 13 and q["modulewise_act_mismatch"] == 0
    assert q["modulewise_max_gemm_rel_err"] < 1e-5
    assert q["layerwise_median_rel_err"] < 1e-4
    assert m["export_vs_fakequant_max_abs_logit_diff"] < m["max_abs_logit_diff"] / 3
    assert m["export_vs_fakequant_kl"] <= 2 * m["noise_floor_kl"] + 1e-6
    assert m["export_vs_fakequant_top1_agreement"] > 0.95


def test_fp8_draft(built):
    d = built.out / "draft_fp8"
    src = built.root / "train_draft" / "draft"
    cfg, orig = json.loads((d / "config.json").read_text()), json.loads((src / "config.json").read_text())
    assert cfg.pop("quantization_config")["quantization"]["quant_algo"] == "FP8"  # ModelOpt embeds hf_quant_config
    assert cfg == orig                                  # the draft's own config, unchanged otherwise
    sd = fp8.read_safetensors(d)
    assert {"fc", "layers.0.self_attn.q_proj", "layers.0.mlp.down_proj"} <= set(fp8.fp8_linear_prefixes(sd))
    assert sd["lm_head.weight"].dtype == torch.bfloat16 and sd["norm.weight"].dtype == torch.bfloat16
    assert "layers.0.self_attn.k_proj.k_scale" in sd     # the draft's KV follows the target's FP8 KV
    assert (d / "tokenizer.json").exists()
    m = built.metrics
    assert 0 <= m["draft_top1_fp8"] <= 1 and 0 <= m["draft_top1_bf16"] <= 1
    assert m["draft_export_vs_fakequant_loss_diff"] < 1e-3   # the written draft, run via runtime.engine.fp8


BREAKS = {
    "missing weight_scale": ("fp8_linears_have_scales", lambda sd, d: sd.pop("model.layers.0.mlp.up_proj.weight_scale")),
    "missing input_scale": ("fp8_linears_have_scales", lambda sd, d: sd.pop("model.layers.0.self_attn.o_proj.input_scale")),
    "NaN scale": ("finite_scales", lambda sd, d: sd.__setitem__("model.layers.0.mlp.up_proj.input_scale",
                                                                torch.tensor(float("nan")))),
    "missing hf_quant_config.json": ("hf_quant_config", lambda sd, d: (d / "hf_quant_config.json").unlink()),
    "config.json "
    "disagrees": ("config_agrees", lambda sd, d: _edit_json(d / "config.json",
                                                            lambda c: c["quantization_config"].update(quant_algo="INT8"))),
    "missing k_scale": ("kv_scales", lambda sd, d: sd.pop("model.layers.1.self_attn.k_proj.k_scale")),
    "excluded module stored as FP8": ("excluded_high_precision", lambda sd, d: _to_fp8(sd, "model.layers.1.mlp.down_proj")),
    "unlisted high-precision linear": ("quantized_coverage", lambda sd, d: sd.__setitem__(
        "model.layers.0.mlp.gate_proj.weight", sd["model.layers.0.mlp.gate_proj.weight"].to(torch.bfloat16))),
    "fused group split": ("fused_groups_consistent", lambda sd, d: _to_high_precision(sd, d, "model.layers.0.self_attn.k_proj")),
    "per-channel scale in a per-tensor checkpoint": ("fp8_linears_have_scales", lambda sd, d: sd.__setitem__(
        "model.layers.0.mlp.up_proj.weight_scale", torch.full((128,), 0.01))),
}


def _to_high_precision(sd, d, p):
    """Store one linear in bf16 and list it as excluded (consistent on its own, but it splits a fused group)."""
    sd[f"{p}.weight"] = fp8.dequantize_weight(sd[f"{p}.weight"], sd.pop(f"{p}.weight_scale"), torch.bfloat16)
    sd.pop(f"{p}.input_scale")
    for f in ("hf_quant_config.json", "config.json"):
        _edit_json(d / f, lambda c, f=f: (c.get("quantization", c.get("quantization_config"))
                                          .setdefault("exclude_modules" if f.startswith("hf") else "ignore", []).append(p)))


def _edit_json(p: Path, fn) -> None:
    doc = json.loads(p.read_text())
    fn(doc)
    p.write_text(json.dumps(doc))


def _to_fp8(sd, p):
    w = sd[f"{p}.weight"].float()
    s = w.abs().max() / 448
    sd[f"{p}.weight"] = (w / s).to(torch.float8_e4m3fn)
    sd[f"{p}.weight_scale"] = s.reshape(())
    sd[f"{p}.input_scale"] = torch.tensor(0.01)


@pytest.mark.parametrize("what", list(BREAKS))
def test_each_format_check_fails_on_a_broken_checkpoint(built, tmp_path, what):
    from safetensors.torch import save_file

    name, brk = BREAKS[what]
    d = tmp_path / "ckpt"
    shutil.copytree(built.out / "target_fp8", d)
    sd = fp8.read_safetensors(d)
    brk(sd, d)
    save_file(sd, str(d / "model.safetensors"))
    res = {c["name"]: c for c in check_checkpoint(d, kv_cache=True, exclude=["model.layers.1.mlp.down_proj"])}
    assert not res[name]["passed"], res[name]
    assert res[name]["message"]
    with pytest.raises(StageError, match=rf"\[{name}\]"):
        Q._raise_failed(list(res.values()), "target_fp8")


def test_kv_check_fails_when_fp8_kv_asked_but_absent(built, tmp_path):
    """A checkpoint quantized without FP8 KV: the kv_scales check passes when none was asked and fails otherwise."""
    samples = Q.read_samples(built.root / "data", "calib", 4, 32)
    m = ptq.quantize_model(built.model_dir, samples, kv_cache="none")
    qexport.export_target(m, tmp_path / "nokv", built.model_dir, torch.bfloat16)
    assert not any(k.endswith(("k_scale", "v_scale")) for k in fp8.read_safetensors(tmp_path / "nokv"))
    ok = {c["name"]: c["passed"] for c in check_checkpoint(tmp_path / "nokv", kv_cache=False)}
    assert all(ok.values()), ok
    asked = {c["name"]: c["passed"] for c in check_checkpoint(tmp_path / "nokv", kv_cache=True)}
    assert asked["kv_scales"] is False


def test_quality_gate_fails_the_stage_naming_the_numbers(built):
    """Both recipes of the try-list are calibrated, exported and measured; neither meets an impossible gate, so the
    stage fails naming each one's numbers, and quality.json reports both (the better one is kept for inspection)."""
    ctx = _ctx(built.root, "out_gate", kv_cache="none", draft="none", max_ppl_increase=0.0, min_top1_agreement=1.0,
               fallback_formats=["fp8_per_channel_per_token"])
    with pytest.raises(StageError) as e:
        Q.run(ctx)
    q = json.loads((ctx.out_dir / "quality.json").read_text())
    msg = str(e.value)
    assert [r["format"] for r in q["recipes"]] == ["fp8", "fp8_per_channel_per_token"]
    assert not any(r["gate_passed"] for r in q["recipes"]) and "fp8_per_channel_per_token:" in msg
    best = min(q["recipes"], key=lambda r: r["ppl_increase"])
    assert q["format"] == best["format"] and q["ppl_fp8"] == best["ppl_fp8"]
    assert fp8.quant_algo(ctx.out_dir / "target_fp8") == Q.RECIPES[best["format"]]["quant_algo"]
    assert e.value.metrics["ppl_fp8"] == q["ppl_fp8"] and e.value.metrics["gate_passed"] is False
    assert "top-1 agreement" in msg and f"{q['top1_agreement']:.4f}" in msg and "min_top1_agreement 1.0" in msg
    if q["ppl_increase"] > 0:
        assert f"{q['ppl_bf16']:.4f}" in msg and f"{q['ppl_fp8']:.4f}" in msg and "max_ppl_increase" in msg
    # the same numbers through the gate function
    msgs = Q.quality_gate({**q, "ppl_increase": 0.031, "ppl_bf16": 10.0, "ppl_fp8": 10.31}, 0.02)
    assert len(msgs) == 1 and "10.0000" in msgs[0] and "10.3100" in msgs[0] and "+3.100%" in msgs[0] and "2.000%" in msgs[0]


def test_config():
    from pydantic import ValidationError

    assert Q.Config().format == "fp8" and Q.Config().draft == "none" and not Q.Config().auto_exclude.enabled
    for bad in ({"format": "int4"}, {"kv_cache": "int8"}, {"exclude_modules": ["*"]}, {"max_ppl_increase": -1},
                {"draft": "nvfp4"}, {"calib_samples": 0}, {"unknown": 1}, {"fallback_formats": ["fp4"]},
                {"auto_exclude": {"enabled": True, "max_layers": 0}}, {"auto_exclude": {"headroom": 1.5}},
                {"auto_exclude": {"typo": 1}}):
        with pytest.raises(ValidationError):
            Q.Config(**bad)
    from stages import train_draft

    cfg = real_config(quantize=Q.Config(draft="fp8"), train_draft=train_draft.Config(algorithm="dflash"))
    assert [p for p, _ in Q.check(cfg)] == ["quantize.draft"]
    cfg.train_draft = train_draft.Config(algorithm="eagle3")
    assert Q.check(cfg) == []
    cfg.train_draft = train_draft.Config(algorithm="eagle3", enabled=False)
    assert "train_draft is disabled" in dict(Q.check(cfg))["quantize.draft"]
    cfg = real_config(quantize=Q.Config(format="fp8", fallback_formats=["fp8"]))
    assert [p for p, _ in Q.check(cfg)] == ["quantize.fallback_formats"]


def test_report_section(built):
    import matplotlib

    matplotlib.use("Agg")
    html = Q.report(Artifact("quantize", built.out, {"metrics": built.metrics}))
    assert "perplexity increase" in html and "finite_scales" in html and "<img" in html
    assert "Recipes tried" in html and "noise floor" in html
    assert "draft top1 fp8" in html


def test_excluding_a_whole_layer_keeps_its_kv_scales(built, tmp_path):
    samples = Q.read_samples(built.root / "data", "calib", 4, 32)
    m = ptq.quantize_model(built.model_dir, samples, kv_cache="fp8", exclude=["model.layers.0.*"])
    qexport.export_target(m, tmp_path / "ex", built.model_dir, torch.bfloat16)
    sd = fp8.read_safetensors(tmp_path / "ex")
    assert sd["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert sd["model.layers.1.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert "model.layers.0.self_attn.k_proj.k_scale" in sd
    res = {c["name"]: c for c in check_checkpoint(tmp_path / "ex", kv_cache=True, exclude=["model.layers.0.*"])}
    assert all(c["passed"] for c in res.values()), res
    typo = {c["name"]: c for c in check_checkpoint(tmp_path / "ex", kv_cache=True, exclude=["model.layer.0.*"])}
    assert not typo["excluded_high_precision"]["passed"] and "matches no linear" in typo["excluded_high_precision"]["message"]


def test_placement_spreads_a_model_larger_than_one_gpu():
    """The decision behind quantize's model placement on GPUs (the dispatch itself needs several GPUs):
    Llama-3.3-70B in bf16 on 8 x H200 is spread, an 8B stays on one, 1.1 TB of weights on one node is refused."""
    from runtime.engine.placement import PlacementError, plan

    h200 = [140 * 2**30] * 8
    assert plan(16 * 10**9, h200) == "one"
    assert plan(141 * 10**9, h200) == "spread"
    assert plan(812 * 10**9, h200) == "spread"      # Llama-3.1-405B in bf16 still fits 85 % of 8 x 140 GiB
    with pytest.raises(PlacementError, match=r"needs 1024\.\d GiB but the 8 visible GPU\(s\) have 1120\.0 GiB free"):
        plan(1100 * 10**9, h200)
    with pytest.raises(PlacementError, match="no CUDA device"):
        plan(1, [])


def test_placement_on_cpu_is_a_plain_move():
    import torch

    from runtime.engine.placement import model_bytes, place

    m = torch.nn.Linear(8, 4)
    assert place(m, "cpu") is m and model_bytes(m) == (8 * 4 + 4) * 4
