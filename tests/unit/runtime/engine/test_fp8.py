"""runtime.engine.fp8: running ModelOpt FP8 unified checkpoints on CPU with TensorRT-LLM's arithmetic.

One module-scoped fixture builds a tiny random Llama (hidden 64, 2 layers), quantizes it with ModelOpt (FP8 per-tensor
weights/activations + FP8 KV) and exports it: with float32 and with bfloat16 high-precision tensors (the latter is what
the quantize stage deploys). The real-model counterparts (SmolLM2) are in tests/unit/stages/test_quantize.py.

Upstream behaviour encoded here (read from source, cited where used):
- TensorRT-LLM cpp/tensorrt_llm/common/cudaFp8Utils.cu (stored version, 2026 copyright; the kernels unchanged in the
  1.2 line): static per-tensor quantization multiplies by 1 / scale (`scaleMatrix<PER_TENSOR>`: factor = 1.0f / s);
  per-token quantization uses s = max(amax / 448, 1 / (448 * 512)) and x / s (`dynamicQuantizeMatrixPerToken`).
- TensorRT-LLM tensorrt_llm/_torch/modules/linear.py @ ed53795b (1.2-era): FP8QDQLinearMethod re-quantizes fused
  q/k/v and gate/up onto max(weight_scale) in the model dtype; FP8RowwiseLinearMethod takes weight_scale [out].
- TensorRT-LLM tensorrt_llm/_torch/attention_backend/trtllm.py @ 9144c0e6: FP8 KV cache with unit scales.
"""
from __future__ import annotations

import copy
import json

import pytest
import torch

from runtime.engine import fp8
from runtime.quant.export import cast_high_precision, export_target
from runtime.quant.ptq import align_with_deployment, kv_unit_scales

VOCAB = 512


def _quantize(model, kv: bool, calib, preset="FP8_DEFAULT_CFG"):
    import modelopt.torch.quantization as mtq

    cfg = copy.deepcopy(getattr(mtq, preset))
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
    out = {"root": root, "x": x, "calib": calib}
    for dtype in (torch.float32, torch.bfloat16, "deployed"):
        if dtype == "deployed":
            # what stages.quantize ships: aligned with the deployment (shared fused scales, exact codes), float32
            # export + bfloat16 cast; its fake-quant logits computed with TensorRT-LLM's unit KV scales
            m = _quantize(LlamaForCausalLM.from_pretrained(root / "ref", dtype=torch.float32).eval(), True, calib)
            align_with_deployment(m)
            with torch.no_grad(), kv_unit_scales(m):
                out["fq_deployed"] = m(input_ids=x).logits
            export_target(m, root / "fp8_deployed", root / "ref", torch.bfloat16)
            out["deployed"] = root / "fp8_deployed"
            continue
        m = _quantize(LlamaForCausalLM.from_pretrained(root / "ref", dtype=torch.float32).eval(), True, calib)
        with torch.no_grad():
            out[f"fq_{dtype}"] = m(input_ids=x).logits  # before export: export rewrites the weights in place
        d = root / f"fp8_{str(dtype)[6:]}"
        # ModelOpt's own dtype argument, then what runtime.quant.export.export_target deploys (float32 export + cast)
        export_hf_checkpoint(m, dtype=dtype, export_dir=d)
        cast_high_precision(d, lambda k, v, dtype=dtype: dtype)
        out[str(dtype)[6:]] = d
    with torch.no_grad():
        out["ref_logits"] = fp8.load_causal_lm(root / "ref")(input_ids=x).logits
    return out


# ModelOpt's raw checkpoint read as ModelOpt's fake-quant model computes it: calibrated KV scales, per-module scales
AS_MODELOPT = {"reading": fp8.FP8Reading(kv_scales="checkpoint", trtllm_fused_scales=False)}


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
        # the stage exports one scale per TensorRT-LLM fused GEMM (q/k/v, gate/up)
        p = f"model.layers.{i}"
        assert len({sd[f"{p}.self_attn.{n}_proj.weight_scale"].item() for n in "qkv"}) == 1
        assert sd[f"{p}.mlp.gate_proj.weight_scale"].item() == sd[f"{p}.mlp.up_proj.weight_scale"].item()


def test_float32_export_reproduces_modelopt_fake_quant(ckpts):
    """Read as ModelOpt's fake-quant model computes (checkpoint KV scales, per-module scales), the float32 export is
    the fake-quant model up to float32 rounding of x * (1/scale) vs x * (448/amax): tolerance 1e-4 on logits of
    magnitude ~1 (measured ~2e-7), at least 100x below the effect of FP8 itself."""
    m = fp8.load_causal_lm(ckpts["float32"], **AS_MODELOPT)
    assert m.fp8_info["fp8_linears"] == 14 and m.fp8_info["kv_scales"] == 2
    with torch.no_grad():
        got = m(input_ids=ckpts["x"]).logits
    fq = ckpts[f"fq_{torch.float32}"]
    diff = (got - fq).abs().max().item()
    effect = (fq - ckpts["ref_logits"]).abs().max().item()
    assert diff < 1e-4
    assert effect > 100 * diff


def test_default_loading_runs_the_checkpoint_as_tensorrt_llm_does(ckpts):
    """ModelOpt 0.47 exports per-tensor q/k/v (and gate/up) with separate scales; TensorRT-LLM fuses them and
    re-quantizes onto the largest scale, and runs the FP8 KV cache with unit scales. The default load does both, so
    on ModelOpt's raw checkpoint it differs from the fake-quant model; the stage's deployed checkpoint (aligned with
    the deployment) is computed the same either way."""
    raw = fp8.load_causal_lm(ckpts["float32"])
    assert raw.fp8_info["kv_scale_mode"] == "unit" and raw.fp8_info["trtllm_fused_scales"]
    k = raw.model.layers[0].self_attn.k_proj
    q = raw.model.layers[0].self_attn.q_proj
    assert torch.equal(k.weight_scale, q.weight_scale) and raw.model.layers[0].self_attn.fp8_k_scale.item() == 1.0
    sd = fp8.read_safetensors(ckpts["float32"])
    assert sd["model.layers.0.self_attn.k_proj.weight_scale"] != sd["model.layers.0.self_attn.q_proj.weight_scale"]
    with torch.no_grad():
        got = raw(input_ids=ckpts["x"]).logits
    assert (got - ckpts[f"fq_{torch.float32}"]).abs().max().item() > 1e-3
    dep = fp8.load_causal_lm(ckpts["deployed"])
    dep2 = fp8.load_causal_lm(ckpts["deployed"], reading=fp8.FP8Reading(trtllm_fused_scales=False))
    with torch.no_grad():
        a, b = dep(input_ids=ckpts["x"]).logits, dep2(input_ids=ckpts["x"]).logits
    assert torch.equal(a, b)                                     # shared scales: the fused re-quantization is a no-op
    assert (a - ckpts["fq_deployed"]).abs().max().item() < 1e-4  # and it is the aligned fake-quant model


def test_deployed_bfloat16_export_reproduces_fake_quant_and_modelopt_bf16_export_does_not(ckpts):
    """stages.quantize exports in float32 and stores the unquantized tensors in bfloat16 afterwards: its FP8
    weights are exactly the fake-quant model's, so the same 1e-4 tolerance holds (the bf16 tensors are exact
    copies of the bf16 reference). ModelOpt's own dtype=bfloat16 export computes weight/weight_scale in
    bfloat16, rounding twice (bf16, then E4M3): a few % of weights land one FP8 step away and the logits move
    by a sizeable fraction of the FP8 effect itself. This test pins both facts."""
    fq = ckpts["fq_deployed"]
    effect = (fq - ckpts["ref_logits"]).abs().max().item()
    with torch.no_grad():
        deployed = fp8.load_causal_lm(ckpts["deployed"])(input_ids=ckpts["x"]).logits
        modelopt_bf16 = fp8.load_causal_lm(ckpts["bfloat16"], **AS_MODELOPT)(input_ids=ckpts["x"]).logits
        modelopt_f32 = fp8.load_causal_lm(ckpts["float32"], **AS_MODELOPT)(input_ids=ckpts["x"]).logits
    assert (deployed - fq).abs().max().item() < 1e-4
    a = fp8.read_safetensors(ckpts["float32"])
    b = fp8.read_safetensors(ckpts["bfloat16"])
    w = "model.layers.0.mlp.up_proj.weight"
    off = (a[w].float() != b[w].float()).float().mean().item()
    assert 0 < off < 0.1, off
    fq32 = ckpts[f"fq_{torch.float32}"]
    assert (modelopt_bf16 - fq32).abs().max().item() > 10 * (modelopt_f32 - fq32).abs().max().item()
    assert effect > 100 * (deployed - fq).abs().max().item()


def test_kv_scales_are_applied(ckpts):
    m = fp8.load_causal_lm(ckpts["float32"], reading=fp8.FP8Reading(apply_kv_scales=False, kv_scales="checkpoint",
                                                                   trtllm_fused_scales=False))
    assert m.fp8_info["kv_scales"] == 0
    with torch.no_grad():
        no_kv = m(input_ids=ckpts["x"]).logits
    fq = ckpts[f"fq_{torch.float32}"]
    assert (no_kv - fq).abs().max().item() > 1e-3  # the KV quantization is a visible part of the FP8 numerics
    m2 = fp8.load_causal_lm(ckpts["float32"], **AS_MODELOPT)
    assert m2.config._attn_implementation.startswith(fp8.KV_ATTN_IMPL)
    sd = fp8.read_safetensors(ckpts["float32"])
    assert m2.model.layers[1].self_attn.fp8_v_scale.item() == sd["model.layers.1.self_attn.v_proj.v_scale"].item()
    # generation with a cache runs through the same path
    out = m2.generate(ckpts["x"][:1, :8], max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 12)
    with pytest.raises(ValueError, match="kv_scales"):
        fp8.load_causal_lm(ckpts["float32"], reading=fp8.FP8Reading(kv_scales="calibrated"))


def test_plain_checkpoint_loads_unchanged(ckpts):
    from transformers import LlamaForCausalLM

    a = fp8.load_causal_lm(ckpts["root"] / "ref")
    b = LlamaForCausalLM.from_pretrained(ckpts["root"] / "ref", dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(a(input_ids=ckpts["x"]).logits, b(input_ids=ckpts["x"]).logits)
    assert a.fp8_info == {"fp8": False}


def test_per_channel_per_token_checkpoint_loads_and_matches_fake_quant(ckpts, tmp_path):
    """ModelOpt's FP8_PER_CHANNEL_PER_TOKEN_CFG export (quant_algo FP8_PER_CHANNEL_PER_TOKEN, weight_scale [out], no
    input_scale; ModelOpt 0.47 unified_export_hf.py) runs with per-channel weights and per-token activations. Module
    by module, on the same inputs, every activation code equals the aligned fake-quant model's except exact rounding
    ties (the first token's attention output is itself a grid of FP8 values: ModelOpt's x * (448/amax) and the
    kernel's x / (amax/448) break those ties differently), and the GEMMs agree to float rounding."""
    from transformers import LlamaForCausalLM

    from runtime.quant.quality import fake_quant_reference, modulewise_agreement

    m = _quantize(LlamaForCausalLM.from_pretrained(ckpts["root"] / "ref", dtype=torch.float32).eval(), True,
                  ckpts["calib"], preset="FP8_PER_CHANNEL_PER_TOKEN_CFG")
    align_with_deployment(m)
    samples = [{"input_ids": r, "loss_mask": torch.ones_like(r)} for r in ckpts["x"]]
    with torch.no_grad(), kv_unit_scales(m):
        fq = m(input_ids=ckpts["x"]).logits
        ref = fake_quant_reference(m, samples, keep=0)
    export_target(m, tmp_path / "pc", ckpts["root"] / "ref", torch.bfloat16)
    q = json.loads((tmp_path / "pc" / "hf_quant_config.json").read_text())["quantization"]
    assert q["quant_algo"] == "FP8_PER_CHANNEL_PER_TOKEN" and fp8.is_fp8_checkpoint(tmp_path / "pc")
    sd = fp8.read_safetensors(tmp_path / "pc")
    assert sd["model.layers.0.mlp.up_proj.weight_scale"].shape == (128,)
    assert "model.layers.0.mlp.up_proj.input_scale" not in sd
    model = fp8.load_causal_lm(tmp_path / "pc")
    assert model.fp8_info["activation"] == "dynamic_per_token" and model.fp8_info["quant_algo"] == "FP8_PER_CHANNEL_PER_TOKEN"
    up = model.model.layers[0].mlp.up_proj
    assert up.per_channel and up.activation == "dynamic_per_token" and up.weight_scale.shape == (128, 1)
    per_module = modulewise_agreement(model, ref["modules"])
    assert len(per_module) == 14
    assert all(v["act_mismatch"] == 0 and v["gemm_rel_err"] < 1e-5 for v in per_module.values()), per_module
    with torch.no_grad():
        got = model(input_ids=ckpts["x"]).logits
    effect = (fq - ckpts["ref_logits"]).abs().max().item()
    diff = (got - fq).abs()
    assert diff.median().item() < 1e-6 and diff.max().item() < effect / 3


def test_static_activation_quantization_multiplies_by_the_reciprocal():
    """TensorRT-LLM's static FP8 quantization computes x * (1 / scale) (cudaFp8Utils.cu scaleMatrix<PER_TENSOR>).
    x = -9.75 with scale 13/448 sits exactly on a tie in x / scale (-336, between -320 and -352): division rounds it
    to even (-320), the reciprocal product is -336.00003 and rounds to -352, which is what the GPU computes."""
    s = torch.tensor(13.0) / 448
    x = torch.tensor([-9.75, 1.0, 100.0])
    got = fp8.qdq_e4m3(x, s) / s
    assert got[0].item() == -352.0 and (x[:1] / s).to(torch.float8_e4m3fn).float().item() == -320.0
    assert got[1].item() == pytest.approx(36.0)       # 1.0 / (13/448) = 34.46 -> 36 (E4M3 step 4 there)
    assert got[2].item() == 448.0                     # saturates at the largest finite E4M3 value


def test_per_token_quantization_on_known_values():
    """s = max(amax(row) / 448, 1 / (448 * 512)) per row, q = E4M3(x / s) (TensorRT-LLM dynamicQuantizeMatrixPerToken)."""
    x = torch.tensor([[2.0, -1.0, 0.5, 0.0],           # amax 2: x / s = 448, -224, 112, 0 exactly
                      [3.0, -1.125, 0.1, 0.0],          # amax 3: -1.125 / (3/448) = -168, a tie -> -160 (even)
                      [1e-4, -2e-4, 0.0, 0.0],          # amax 2e-4 < 1/512: the floor scale 1/(448*512) applies
                      [0.0, 0.0, 0.0, 0.0]])            # an all-zero row stays zero (no division by zero)
    q, s = fp8.quantize_per_token(x)
    assert s.shape == (4, 1) and q.dtype == torch.float8_e4m3fn
    assert s[0].item() == pytest.approx(2 / 448) and s[2].item() == s[3].item() == pytest.approx(1 / (448 * 512))
    assert q[0].float().tolist() == [448.0, -224.0, 112.0, 0.0]
    assert q[1, 1].item() == -160.0
    assert q[2].float().tolist() == [22.0, -44.0, 0.0, 0.0]   # x / s = 22.94, -45.88 -> nearest E4M3 22, -44
    assert torch.equal(q[3].float(), torch.zeros(4))
    deq = fp8.qdq_per_token(x)
    assert torch.allclose(deq[0], x[0]) and deq[1, 1].item() == pytest.approx(-160 * 3 / 448)
    # FP8Linear with dynamic per-token activations uses exactly this, with per-channel weight scales
    w = torch.randn(3, 4)
    ws = w.abs().amax(dim=1) / 448
    wq = fp8.quantize_weight(w, ws)
    lin = fp8.FP8Linear(wq, ws, torch.tensor(0.5), dynamic_per_token=True)   # an input_scale is ignored (rowwise)
    assert lin.activation == "dynamic_per_token" and lin.input_scale is None and lin.per_channel
    expect = deq @ (wq.float() * ws[:, None]).T
    assert torch.allclose(lin(x), expect, atol=1e-6)


def test_per_channel_weight_scales():
    torch.manual_seed(3)
    w = torch.randn(8, 16)
    ws = w.abs().amax(dim=1) / 448
    wq = fp8.quantize_weight(w, ws)
    assert torch.equal(wq, (w / ws[:, None]).to(torch.float8_e4m3fn))
    for shape in ((8,), (8, 1)):
        lin = fp8.FP8Linear(wq, ws.reshape(shape))
        assert torch.equal(lin.dequantized_weight(), wq.float() * ws[:, None])
    with pytest.raises(ValueError, match="weight_scale has 4 elements"):
        fp8.FP8Linear(wq, ws[:4])


def test_trtllm_fuse_scales_requantizes_like_tensorrt_llm():
    """FP8QDQLinearMethod.load_weights_fused_qkv_linear (linear.py @ ed53795b): weight_scale = max(scales);
    w_i = w_i.to(bf16) * scale_i; fused = (cat(w) / weight_scale).to(float8); input_scale = max(input_scales)."""
    torch.manual_seed(4)
    scales = [torch.tensor(0.3), torch.tensor(0.2), torch.tensor(0.07)]
    codes = [(torch.randn(6, 8) * 100).clamp(-448, 448).to(torch.float8_e4m3fn) for _ in scales]
    lins = {f"layer.{n}": fp8.FP8Linear(c, s, torch.tensor(0.01 * (i + 1)))
            for i, (n, c, s) in enumerate(zip(("q_proj", "k_proj", "v_proj"), codes, scales, strict=True))}
    lins["layer.o_proj"] = fp8.FP8Linear(codes[0].clone(), torch.tensor(0.05), torch.tensor(0.01))
    changed = fp8.trtllm_fuse_scales(lins, torch.bfloat16)
    assert changed == [["layer.q_proj", "layer.k_proj", "layer.v_proj"]]
    smax = torch.tensor(0.3)
    for n, c, s in zip(("q_proj", "k_proj", "v_proj"), codes, scales, strict=True):
        expect = ((c.to(torch.bfloat16) * s) / smax).to(torch.float8_e4m3fn)
        lin = lins[f"layer.{n}"]
        assert torch.equal(lin.weight.float(), expect.float()) and lin.weight_scale.item() == pytest.approx(0.3)
        assert lin.input_scale.item() == pytest.approx(0.03)
    assert torch.equal(lins["layer.q_proj"].weight.float(), codes[0].float())   # the max member keeps its codes
    assert not torch.equal(lins["layer.v_proj"].weight.float(), codes[2].float())  # the others are re-rounded
    assert lins["layer.o_proj"].weight_scale.item() == pytest.approx(0.05)          # not a fused member
    assert fp8.trtllm_fuse_scales(lins, torch.bfloat16) == []                      # idempotent
    # per-channel members are concatenated by TensorRT-LLM (FP8RowwiseLinearMethod): left alone
    pc = {f"l.{n}": fp8.FP8Linear(c, torch.full((6,), 0.1 * (i + 1)), dynamic_per_token=True)
          for i, (n, c) in enumerate(zip(("gate_proj", "up_proj"), codes, strict=False))}
    assert fp8.trtllm_fuse_scales(pc) == [] and pc["l.up_proj"].weight_scale[0].item() == pytest.approx(0.2)


def test_tied_embeddings_share_one_tensor_and_a_diverging_head_is_refused(tmp_path):
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(5)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True)
    cfg.architectures = ["LlamaForCausalLM"]
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "ref")
    m = _quantize(LlamaForCausalLM.from_pretrained(tmp_path / "ref", dtype=torch.float32).eval(), False,
                  [torch.randint(0, VOCAB, (1, 16))])
    export_target(m, tmp_path / "t", tmp_path / "ref", torch.bfloat16)
    sd = fp8.read_safetensors(tmp_path / "t")
    assert "lm_head.weight" not in sd     # ModelOpt drops the alias; config.json keeps tie_word_embeddings
    assert json.loads((tmp_path / "t" / "config.json").read_text())["tie_word_embeddings"] is True
    model = fp8.load_causal_lm(tmp_path / "t")
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.fp8_info["tied_embeddings"]
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"] + 1
    save_file(sd, str(tmp_path / "t" / "model.safetensors"))
    with pytest.raises(ValueError, match="ties the input and output embeddings but lm_head.weight differs"):
        fp8.load_causal_lm(tmp_path / "t")


def test_fp8linear_arithmetic():
    torch.manual_seed(1)
    w = torch.randn(32, 16)
    ws = w.abs().max() / fp8.FP8_MAX
    wq = (w / ws).to(torch.float8_e4m3fn)
    x = torch.randn(3, 16) * 5
    xs = torch.tensor(0.01)  # small scale: values beyond 448*0.01 = 4.48 saturate
    lin = fp8.FP8Linear(wq, ws, xs, bias=torch.ones(32))
    assert lin.activation == "static" and not lin.per_channel
    xq = (x * (1.0 / xs)).clamp(-448, 448).to(torch.float8_e4m3fn).float() * xs
    expect = xq @ (wq.float() * ws).T + 1
    assert torch.allclose(lin(x), expect, atol=1e-6)
    assert fp8.qdq_e4m3(torch.tensor([100.0]), xs).item() == pytest.approx(4.48)
    weight_only = fp8.FP8Linear(wq, ws)
    assert weight_only.activation == "none"
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
