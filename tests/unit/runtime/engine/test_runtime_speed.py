"""The runtime's fast paths compute what they claim (runtime/engine/fused.py `Gemm`, `LogitsHead`, `FusedLayer`;
runtime/engine/fp8/linear.py `qdq_e4m3_fast`; runtime/engine/target.py `TargetRunner(compute=...)`).

- `fp32` (the default, the exact mode every stage uses): the fused forward is the Hugging Face forward of the same
  modules, on the tiny target and on SmolLM2 (logits, greedy tokens), with FP8Linear layers of both recipes it is
  `runtime.engine.fp8`'s executor; speculative decoding with k + 1 rows per verification gives autoregressive decoding's
  tokens on the real model (validate's exact lossless check rests on this).
- `bf16` (opt-in, serving on CPU): its documented contract (docs/serving.md "Compute modes"): the lm_head's argmax is
  the exact argmax of the bf16 input's logits; on SmolLM2, logits within 1.0 of the exact mode's and >= 97 % of
  teacher-forced greedy choices the same.
"""
from __future__ import annotations

import pytest
import torch

from runtime.engine.fp8.linear import qdq_e4m3_fast
from runtime.engine.fused import LogitsHead
from runtime.engine.speculative import SpeculativeEngine
from runtime.engine.target import TargetRunner, load_target

# ---------------------------------------------------------------------------------------------- FP8 arithmetic


def test_fast_qdq_is_the_reference_qdq_bit_for_bit():
    """qdq_e4m3_fast == runtime.engine.fp8.qdq_e4m3 (TensorRT-LLM's x * (1/scale)), including the value where x / scale
    and x * (1/scale) round to different E4M3 codes (tests/unit/runtime/engine/test_fp8.py, -9.75 at scale 13/448), saturation and
    subnormals."""
    from runtime.engine.fp8 import qdq_e4m3

    s = torch.tensor(13.0) / 448
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.tensor([-9.75, 9.75, 1e-6, -1e-5, 1e4, -1e4, 0.0]),
                   torch.randn(20000, generator=g) * 4, torch.randn(20000, generator=g) * 0.01])
    for scale in (s, torch.tensor(0.0173), torch.tensor(1.0)):
        assert torch.equal(qdq_e4m3_fast(x, scale), qdq_e4m3(x, scale)), scale


def _fp8_model(model, recipe: str):
    """`model` (a float32 HF Llama) with every projection of its layers replaced by a `runtime.engine.fp8.FP8Linear`
    holding the E4M3 codes of its weight: `static` per-tensor weight and input scales (the FP8 recipe), or
    per-channel weight scales with per-token activations (FP8_PER_CHANNEL_PER_TOKEN), as runtime.engine.fp8 loads them."""
    from runtime.engine.fp8 import FP8_MAX, FP8Linear, quantize_weight

    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for n in names:
                lin = getattr(parent, n, None)
                if lin is None:
                    continue
                w = lin.weight.detach().float()
                if recipe == "static":
                    ws = w.abs().max() / FP8_MAX
                    m = FP8Linear(quantize_weight(w, ws), ws, torch.tensor(0.011 if n != "down_proj" else 0.02))
                else:
                    ws = w.abs().amax(1) / FP8_MAX
                    m = FP8Linear(quantize_weight(w, ws), ws, dynamic_per_token=True)
                setattr(parent, n, m)
    return model.eval()


@pytest.mark.parametrize("recipe", ["static", "per_token"])
def test_fp8_fused_forward_is_the_fp8_executor(recipe):
    """FP8Linear layers (both recipes) run as fused GEMMs (not module by module) and the fp32-mode forward gives
    the Hugging Face forward through runtime.engine.fp8's FP8Linear modules: same logits (float32 rounding), same greedy
    tokens; the bf16 mode's FP8 GEMMs are FP8Linear's output to bf16 rounding."""
    from support.tiny_models import tiny_assets

    tiny = tiny_assets()
    model = _fp8_model(load_target(tiny["target_dir"]), recipe)
    r = TargetRunner(model)
    kinds = {G.kind for L in r.plan.layers for G in (L.qkv, L.o, L.gate_up, L.down)}
    assert kinds == {"fp8" if recipe == "static" else "fp8_tok"}, kinds      # every projection fused
    p = tiny["prompts"][1]
    with torch.no_grad():
        ref = model(torch.tensor([p])).logits[0].float()
        r.reset(1, len(p) + 4)
        got, _ = r.forward(torch.tensor([p]))
    torch.testing.assert_close(got[0], ref, atol=2e-5, rtol=1e-5)
    hf = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                        max_new_tokens=16, do_sample=False, eos_token_id=None)[0, len(p):].tolist()
    assert SpeculativeEngine(model, drafter=None).generate([p], max_new_tokens=16).tokens[0] == hf
    # bf16 mode: an FP8 GEMM with a bf16 output (codes x codes exact, accumulated in float32, then scaled)
    b = TargetRunner(model, compute="bf16")
    x = torch.randn(3, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    mlp = model.model.layers[0].mlp
    with torch.no_grad():
        want = torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], -1)
        y = b.plan.layers[0].gate_up(x)
    assert ((y - want).abs() <= want.abs() * 2 ** -8 + 1e-4 * want.abs().max()).all()


# ---------------------------------------------------------------------------------------------- tiny target


def test_fp32_mode_decode_steps_are_the_hf_forward():
    """On the tiny target, each one-token decode step of the fused fp32 forward gives the logits of a fresh
    Hugging Face forward over the whole sequence (to float32 rounding)."""
    from support.tiny_models import tiny_assets

    tiny = tiny_assets()
    model = load_target(tiny["target_dir"])
    p = tiny["prompts"][0]
    r = TargetRunner(model)
    r.reset(1, len(p) + 8)
    seq = list(p)
    with torch.no_grad():
        lg, _ = r.forward(torch.tensor([seq]))
        r.commit(torch.tensor([len(seq)]))
        for _ in range(6):
            nxt = int(lg[0, -1].argmax())
            seq.append(nxt)
            lg, _ = r.forward(torch.tensor([[nxt]]))
            r.commit(torch.tensor([1]))
            ref = model(torch.tensor([seq])).logits[0, -1].float()
            torch.testing.assert_close(lg[0, -1], ref, atol=1e-5, rtol=1e-5)


def test_bf16_lm_head_argmax_is_the_exact_argmax_of_its_input():
    """The bf16 lm_head's output is rounded to 8 bits, so near-ties at the top are decided by rounding; LogitsHead
    recomputes the candidates exactly: its argmax is the argmax of the float64 logits of the bf16-rounded input
    with the bf16 weight, on every row, including rows whose top two tie in bf16."""
    g = torch.Generator().manual_seed(0)
    V, H = 4096, 96
    lin = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(V, H, generator=g) * 0.05)
        lin.weight[1:64] = lin.weight[0] + torch.randn(63, H, generator=g) * 1e-3     # many near-tied rows
    x = torch.randn(512, H, generator=g) * 20
    x[:256] = lin.weight[0] * 300 + torch.randn(256, H, generator=g) * 0.1          # rows whose top is that group
    head = LogitsHead(lin, "bf16", "cpu")
    with torch.no_grad():
        y = head(x)
    exact = x.to(torch.bfloat16).double() @ lin.weight.detach().to(torch.bfloat16).double().t()
    rounded = (x.to(torch.bfloat16).double() @ lin.weight.detach().to(torch.bfloat16).double().t()).to(torch.bfloat16)
    assert (rounded.float().argmax(-1) != exact.argmax(-1)).any()     # bf16 rounding alone would pick wrong
    assert torch.equal(y.argmax(-1), exact.argmax(-1))


def test_serving_engine_takes_the_exported_compute_mode():
    """The CPU model's ServingEngine runs the runtime in the mode it is given (export.cpu_compute), fp32 unless
    told otherwise; an unknown mode is refused naming the valid ones."""
    from runtime.serving.adapter import ServingEngine

    from support.tiny_models import tiny_assets

    d = tiny_assets()["target_dir"]
    assert ServingEngine(d, None, draft_len=0).engine.target.plan.compute == "fp32"
    eng = ServingEngine(d, None, draft_len=0, compute="bf16").engine
    assert eng.compute == "bf16" and eng.target.plan.layers[0].qkv.w.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="fp32.*bf16.*auto"):
        ServingEngine(d, None, draft_len=0, compute="fast")
