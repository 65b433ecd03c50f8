"""runtime.fp8: running ModelOpt FP8 unified checkpoints on CPU, against ModelOpt's own fake-quant model.

One module-scoped fixture builds a tiny random Llama (hidden 64, 2 layers), quantizes it with ModelOpt
(FP8 weights/activations + FP8 KV) and exports it twice: with float32 and with bfloat16 high-precision
tensors (the latter is what the quantize stage deploys)."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from runtime import fp8
from stages.quantize import cast_high_precision, export_target

VOCAB = 512


def _quantize(model, kv: bool, calib):
    import modelopt.torch.quantization as mtq

    cfg = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
    if kv:
        cfg["quant_cfg"] = cfg["quant_cfg"] + copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"])

    def loop(m):
        with torch.no_grad():
            for x in calib:
                m(input_ids=x)

    return mtq.quantize(model, cfg, loop)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("fp8")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    cfg.architectures = ["LlamaForCausalLM"]
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(root / "ref")
    calib = [torch.randint(0, VOCAB, (1, 48)) for _ in range(6)]
    x = torch.randint(0, VOCAB, (2, 40))
    out = {"root": root, "x": x}
    for dtype in (torch.float32, torch.bfloat16, "deployed"):
        if dtype == "deployed":
            m = _quantize(LlamaForCausalLM.from_pretrained(root / "ref", dtype=torch.float32).eval(), True, calib)
            export_target(m, root / "fp8_deployed", root / "ref", torch.bfloat16)
            out["deployed"] = root / "fp8_deployed"
            continue
        m = _quantize(LlamaForCausalLM.from_pretrained(root / "ref", dtype=torch.float32).eval(), True, calib)
        with torch.no_grad():
            out[f"fq_{dtype}"] = m(input_ids=x).logits  # before export: export rewrites the weights in place
        d = root / f"fp8_{str(dtype)[6:]}"
        # ModelOpt's own dtype argument, then what stages.quantize.export_target deploys (float32 export + cast)
        export_hf_checkpoint(m, dtype=dtype, export_dir=d)
        cast_high_precision(d, lambda k, v: dtype)
        out[str(dtype)[6:]] = d
    with torch.no_grad():
        out["ref_logits"] = fp8.load_causal_lm(root / "ref")(input_ids=x).logits
    return out


def test_checkpoint_files_and_dtypes_as_tensorrt_llm_expects(ckpts):
    d = ckpts["deployed"]
    assert {"config.json", "hf_quant_config.json", "model.safetensors"} <= {p.name for p in d.iterdir()}
    q = json.loads((d / "hf_quant_config.json").read_text())["quantization"]
    assert q["quant_algo"] == "FP8" and q["kv_cache_quant_algo"] == "FP8"
    assert set(q["exclude_modules"]) >= {"lm_head", "model.embed_tokens"}
    assert fp8.is_fp8_checkpoint(d) and not fp8.is_fp8_checkpoint(ckpts["root"] / "ref")
    sd = fp8.read_safetensors(d)
    lin = fp8.fp8_linear_prefixes(sd)
    assert len(lin) == 2 * 7  # q k v o gate up down per layer
    for p in lin:
        assert sd[f"{p}.weight"].dtype == torch.float8_e4m3fn
        for s in ("weight_scale", "input_scale"):
            assert sd[f"{p}.{s}"].dtype == torch.float32 and sd[f"{p}.{s}"].numel() == 1
    for k in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight"):
        assert sd[k].dtype == torch.bfloat16, k
    for i in range(2):
        assert sd[f"model.layers.{i}.self_attn.k_proj.k_scale"].numel() == 1
        assert sd[f"model.layers.{i}.self_attn.v_proj.v_scale"].numel() == 1


def test_float32_export_reproduces_modelopt_fake_quant(ckpts):
    """With float32 high-precision tensors the exported checkpoint is the fake-quant model, bit for bit up to
    float32 rounding of x/scale vs x*(448/amax): tolerance 1e-4 on logits of magnitude ~1 (measured ~2e-7),
    at least 100x below the effect of FP8 itself."""
    m = fp8.load_causal_lm(ckpts["float32"])
    assert m.fp8_info["fp8_linears"] == 14 and m.fp8_info["kv_scales"] == 2
    with torch.no_grad():
        got = m(input_ids=ckpts["x"]).logits
    fq = ckpts[f"fq_{torch.float32}"]
    diff = (got - fq).abs().max().item()
    effect = (fq - ckpts["ref_logits"]).abs().max().item()
    assert diff < 1e-4
    assert effect > 100 * diff


def test_deployed_bfloat16_export_reproduces_fake_quant_and_modelopt_bf16_export_does_not(ckpts):
    """stages.quantize exports in float32 and stores the unquantized tensors in bfloat16 afterwards: its FP8
    weights are exactly the fake-quant model's, so the same 1e-4 tolerance holds (the bf16 tensors are exact
    copies of the bf16 reference). ModelOpt's own dtype=bfloat16 export computes weight/weight_scale in
    bfloat16, rounding twice (bf16, then E4M3): a few % of weights land one FP8 step away and the logits move
    by a sizeable fraction of the FP8 effect itself. This test pins both facts."""
    fq = ckpts[f"fq_{torch.float32}"]
    effect = (fq - ckpts["ref_logits"]).abs().max().item()
    with torch.no_grad():
        deployed = fp8.load_causal_lm(ckpts["deployed"])(input_ids=ckpts["x"]).logits
        modelopt_bf16 = fp8.load_causal_lm(ckpts["bfloat16"])(input_ids=ckpts["x"]).logits
    assert (deployed - fq).abs().max().item() < 1e-4
    a = fp8.read_safetensors(ckpts["deployed"])
    b = fp8.read_safetensors(ckpts["bfloat16"])
    w = "model.layers.0.mlp.up_proj.weight"
    off = (a[w].float() != b[w].float()).float().mean().item()
    assert 0 < off < 0.1, off
    assert (modelopt_bf16 - fq).abs().max().item() > 10 * (deployed - fq).abs().max().item()
    assert effect > 100 * (deployed - fq).abs().max().item()


def test_kv_scales_are_applied(ckpts):
    m = fp8.load_causal_lm(ckpts["float32"], apply_kv_scales=False)
    assert m.fp8_info["kv_scales"] == 0
    with torch.no_grad():
        no_kv = m(input_ids=ckpts["x"]).logits
    fq = ckpts[f"fq_{torch.float32}"]
    assert (no_kv - fq).abs().max().item() > 1e-3  # the KV quantization is a visible part of the FP8 numerics
    m2 = fp8.load_causal_lm(ckpts["float32"])
    assert m2.config._attn_implementation.startswith(fp8.KV_ATTN_IMPL)
    # generation with a cache runs through the same path
    out = m2.generate(ckpts["x"][:1, :8], max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 12)


def test_plain_checkpoint_loads_unchanged(ckpts):
    from transformers import LlamaForCausalLM

    a = fp8.load_causal_lm(ckpts["root"] / "ref")
    b = LlamaForCausalLM.from_pretrained(ckpts["root"] / "ref", dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(a(input_ids=ckpts["x"]).logits, b(input_ids=ckpts["x"]).logits)
    assert a.fp8_info == {"fp8": False}


def test_fp8linear_arithmetic():
    torch.manual_seed(1)
    w = torch.randn(32, 16)
    ws = w.abs().max() / fp8.FP8_MAX
    wq = (w / ws).to(torch.float8_e4m3fn)
    x = torch.randn(3, 16) * 5
    xs = torch.tensor(0.01)  # small scale: values beyond 448*0.01 = 4.48 saturate
    lin = fp8.FP8Linear(wq, ws, xs, bias=torch.ones(32))
    xq = (x / xs).clamp(-448, 448).to(torch.float8_e4m3fn).float() * xs
    expect = xq @ (wq.float() * ws).T + 1
    assert torch.allclose(lin(x), expect, atol=1e-6)
    assert fp8.qdq_e4m3(torch.tensor([100.0]), xs).item() == pytest.approx(4.48)
    weight_only = fp8.FP8Linear(wq, ws)
    assert torch.allclose(weight_only(x), x @ (wq.float() * ws).T, atol=1e-5)
    with pytest.raises(TypeError):
        fp8.FP8Linear(w, ws)


def test_swap_and_load_on_any_module_tree():
    """The draft runtime's path: a module tree transformers does not know, loaded from an FP8 state dict."""
    torch.manual_seed(2)

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(16, 8, bias=False)
            self.norm = torch.nn.LayerNorm(8)
            self.register_buffer("d2t", torch.zeros(4, dtype=torch.long))

    w = torch.randn(8, 16)
    ws = w.abs().max() / 448
    sd = {"fc.weight": (w / ws).to(torch.float8_e4m3fn), "fc.weight_scale": ws, "fc.input_scale": torch.tensor(0.02),
          "norm.weight": torch.ones(8, dtype=torch.bfloat16), "norm.bias": torch.zeros(8, dtype=torch.bfloat16),
          "d2t": torch.arange(4)}
    m = Tiny()
    info = fp8.load_fp8_state_dict(m, sd)
    assert info["fp8_linears"] == ["fc"] and isinstance(m.fc, fp8.FP8Linear)
    assert torch.equal(m.d2t, torch.arange(4)) and m.norm.weight.dtype == torch.float32
    assert set(fp8.fp8_linears_from_state_dict(sd)) == {"fc"}
    plain = fp8.load_state_dict_dequantized(sd)
    assert set(plain) == {"fc.weight", "norm.weight", "norm.bias", "d2t"} and plain["d2t"].dtype == torch.long
    assert torch.allclose(plain["fc.weight"], w, rtol=0.07, atol=1e-6)  # E4M3: 3 mantissa bits
    with pytest.raises(KeyError, match="missing"):
        fp8.load_fp8_state_dict(Tiny(), {k: v for k, v in sd.items() if k != "norm.bias"})
    with pytest.raises(KeyError, match="weight_scale"):
        fp8.fp8_linears_from_state_dict({"fc.weight": sd["fc.weight"]})
    with pytest.raises(ValueError, match="shape"):
        fp8.swap_fp8_linears(torch.nn.Sequential(), {}) or fp8.swap_fp8_linears(
            type("M", (torch.nn.Module,), {})(), {}) or fp8.swap_fp8_linears(_with_fc(16, 4), sd)


def _with_fc(i, o):
    m = torch.nn.Module()
    m.fc = torch.nn.Linear(i, o)
    return m
