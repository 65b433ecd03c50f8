"""The runtime's fused execution of Llama-style layers, what `runtime.engine.target.TargetRunner` and a draft's
`DraftPlan` (`runtime.engine.drafts.blocks`) run: `Gemm` (the linears that read one input as one GEMM, dense or
FP8, in the fp32 or bf16 compute mode of `runtime.engine.compute`), `LogitsHead` (the lm_head, with the exact
near-tie refinement of the bf16 mode), `Norm` (RMSNorm through `F.rms_norm` where that is bit-identical) and
`FusedLayer` (a decoder layer as fused q/k/v, o, gate/up and down GEMMs)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.engine.fp8.linear import dequantize_weight, qdq_e4m3_fast, qdq_per_token, quantize_per_token
from runtime.engine.layers import rope_heads

_FP8 = torch.float8_e4m3fn
_FP8_MAX = 448.0
# What an FP8Linear (runtime.engine.fp8) holds when it computes qdq(x, input_scale) @ (weight * weight_scale)^T + bias;
# one with anything else (another recipe) runs through its own forward instead of a fused GEMM.
_FP8_BUFFERS = {"weight", "weight_scale", "input_scale", "bias"}
_FP8_ATTRS = {"out_features", "in_features", "compute_dtype", "use_scaled_mm", "dynamic_per_token", "_w_cache"}


def _e4m3_codes(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The E4M3 codes `qdq_e4m3` rounds x to (x * (1 / scale), saturated), as float8."""
    return (x.float() * (1.0 / scale)).clamp_(-_FP8_MAX, _FP8_MAX).to(_FP8)


def _onednn_bf16() -> bool:
    """oneDNN can run bf16 matmuls here (natively or emulated); without it the bf16 mode uses torch's own kernels."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _linear_kind(m: nn.Module) -> str | None:
    """'dense' (nn.Linear), 'fp8' (an FP8Linear with a static per-tensor input scale, or weight-only), 'fp8_tok'
    (an FP8Linear with dynamic per-token activations), or None (run the module itself)."""
    if type(m) is nn.Linear:
        return "dense"
    w = getattr(m, "weight", None)
    if type(m).__name__ == "FP8Linear" and isinstance(w, torch.Tensor) and w.dtype == _FP8:
        own = {k for k in vars(m) if not k.startswith("_") or k == "_w_cache"} - {"training"}
        if set(m._buffers) <= _FP8_BUFFERS and own <= _FP8_ATTRS and not m._modules:
            ws, si = m.weight_scale, m.input_scale
            if getattr(m, "use_scaled_mm", False) and w.is_cuda:
                return None                      # the real FP8 GEMM (torch._scaled_mm) runs in the module
            if ws.numel() in (1, w.shape[0]) and getattr(m, "dynamic_per_token", False):
                return "fp8_tok"
            if ws.numel() in (1, w.shape[0]) and (si is None or si.numel() == 1):
                return "fp8"
    return None


class Gemm:
    """y = x @ W^T (+ b) of one or several linears that read the same input (q/k/v, gate/up), as ONE GEMM over
    their weights concatenated along the output dimension at build time; returns the concatenated outputs in the
    activation dtype (float32, or the loaded parameters' dtype in the fp32 mode).

    fp32 mode: dense weights as loaded (on CPU stored transposed, [in, out], which MKL runs faster at 2-20 rows);
    FP8 linears as `runtime.engine.fp8.FP8Linear` emulates them: qdq(x) @ (weight * weight_scale)^T, qdq with the static
    input scale or per token (FP8_PER_CHANNEL_PER_TOKEN; one row's scale is shared by the fused members).
    bf16 mode, on CPU through oneDNN with the weights reordered once for its kernels: dense weights in bf16,
    activations rounded to bf16; FP8 linears multiply the E4M3 codes of the quantized activation and of the weight
    (both exact in bf16, their products exact in the float32 accumulator) and scale the result by
    input_scale (or the row's per-token scale) * weight_scale, i.e. FP8Linear's arithmetic with the output
    rounded to bf16, as an FP8 GEMM with
    a bf16 output does on a GPU. A group whose members differ (kind, input scale) is not fused: each member runs
    through its own module and the outputs are concatenated."""

    def __init__(self, mods: list[nn.Module], compute: str, device):
        self.splits = [int(m.out_features) for m in mods]
        self.in_features = int(mods[0].in_features)
        self.compute = compute
        self.device = torch.device(device)
        kinds = {_linear_kind(m) for m in mods}
        kind = kinds.pop() if len(kinds) == 1 else None
        if kind == "fp8":
            si = [m.input_scale for m in mods]
            if not (all(s is None for s in si) or (all(s is not None for s in si)
                                                   and all(torch.equal(s, si[0]) for s in si))):
                kind = None
        self.kind = kind
        self.mods = mods
        if kind is None:
            return
        bias = [m.bias for m in mods]
        self.bias = (torch.cat([b.detach().float() if b is not None else torch.zeros(n, device=self.device)
                                for b, n in zip(bias, self.splits, strict=True)]) if any(b is not None for b in bias) else None)
        cpu = self.device.type == "cpu"
        if kind == "dense":
            w = torch.cat([m.weight.detach() for m in mods])
            self.act_dtype = w.dtype if w.is_floating_point() else torch.float32
            self.scale = self.in_scale = None
            if self.bias is not None:
                self.bias = self.bias.to(self.act_dtype)
            if compute == "bf16":
                self._w_exact = w            # for `LogitsHead` refinement (no copy: concatenation of one is a view)
                w = w.to(torch.bfloat16)
        else:
            self.act_dtype = mods[0].compute_dtype
            s_in = mods[0].input_scale if kind == "fp8" else None
            self.in_scale = None if s_in is None else s_in.detach().float().reshape(()).to(self.device)
            if compute == "bf16":
                w = torch.cat([m.weight for m in mods]).to(torch.bfloat16)            # E4M3 codes, exact in bf16
                ws = torch.cat([m.weight_scale.detach().float().reshape(-1).expand(n)
                                for m, n in zip(mods, self.splits, strict=True)])
                self.scale = ws * (self.in_scale if self.in_scale is not None else 1.0)
                self._w_exact = None
            else:
                w = torch.cat([dequantize_weight(m.weight, m.weight_scale, self.act_dtype) for m in mods])
                self.scale = None
            if self.bias is not None and compute != "bf16":
                self.bias = self.bias.to(self.act_dtype)
        if compute == "bf16" and cpu and _onednn_bf16():
            self.w = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None)
            self._op = "onednn"
        elif cpu and compute != "bf16":
            self.w = w.t().contiguous()
            self._op = "mm"
        else:
            self.w = w.contiguous()
            self._op = "linear"

    @property
    def out_features(self) -> int:
        return sum(self.splits)

    def _quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the GEMM operand, a per-row scale or None). bf16 mode: the activation in bf16, or for an FP8 linear the
        E4M3 codes of the quantized activation in bf16 (per-token: with each row's scale, applied after the GEMM);
        fp32 mode: the activation as FP8Linear feeds its GEMM (through E4M3 with the input scale, or per-token
        quantize-dequantize)."""
        if self.compute == "bf16":
            if self.kind == "fp8_tok":
                q, s = quantize_per_token(x)
                return q.to(torch.bfloat16), s
            if self.kind == "fp8" and self.in_scale is not None:
                return _e4m3_codes(x, self.in_scale).to(torch.bfloat16), None
            return x.to(torch.bfloat16), None
        if x.dtype != self.act_dtype:
            x = x.to(self.act_dtype)
        if self.kind == "fp8_tok":
            return qdq_per_token(x), None
        if self.kind == "fp8" and self.in_scale is not None:
            x = qdq_e4m3_fast(x, self.in_scale)
        return x, None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind is None:
            outs = [m(x) for m in self.mods]
            return outs[0] if len(outs) == 1 else torch.cat(outs, -1)
        return self._gemm(*self._quantize_input(x))

    def promoting(self, x: torch.Tensor) -> torch.Tensor:
        """As `__call__`, but in the bf16 mode the output may stay bf16 (no scale or bias to apply): for a caller
        whose next op takes it together with a float32 tensor (type promotion converts it exactly), saving a
        conversion op."""
        if self.kind is None or self.compute != "bf16" or self.scale is not None or self.bias is not None:
            return self(x)
        return self._gemm(*self._quantize_input(x), promote=False)

    def _gemm(self, xq: torch.Tensor, row_scale: torch.Tensor | None = None, promote: bool = True) -> torch.Tensor:
        if self._op == "mm":                              # fp32 on CPU: x @ W^T with W^T stored contiguous
            return torch.matmul(xq, self.w) if self.bias is None else torch.matmul(xq, self.w).add_(self.bias)
        if self._op == "linear":
            y = F.linear(xq, self.w, None if self.compute == "bf16" else self.bias)
        else:
            y = torch.ops.mkldnn._linear_pointwise(xq, self.w, None, "none", [], "")
        if self.compute != "bf16" or not promote:
            return y
        y = y.float() if self.scale is None else y * self.scale      # bf16 * float32 -> float32
        if row_scale is not None:
            y = y.mul_(row_scale)
        return y if self.bias is None else y.add_(self.bias)


class LogitsHead(Gemm):
    """The lm_head as a `Gemm`. In the bf16 mode the GEMM's bf16 output carries 8 significant bits (a logit near
    20 is rounded to a multiple of 0.125), so near-ties at the top would be decided by rounding: every logit
    within the rounding bound of a row's maximum is recomputed exactly (float64 dot product of the bf16-rounded
    input with the weight row, rounded to float32), so the argmax is the argmax of the exact logits of the bf16
    input, whatever the GEMM's accumulation order; logits further down keep the bf16 value (they cannot be the
    maximum; as probabilities they are within 2^-8 relative of exact)."""

    def __init__(self, mod: nn.Module, compute: str, device, refine: bool = True):
        super().__init__([mod], compute, device)
        self.refine = refine and compute == "bf16" and self.kind == "dense"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind is None:
            return self.mods[0](x).float()
        xq, rs = self._quantize_input(x)
        y = self._gemm(xq, rs)
        if not self.refine:
            return y.float()
        y2 = y.view(-1, y.shape[-1])
        top = y2.max(-1, keepdim=True).values
        # |bf16(v) - v| <= 2^-8 |v|, and every v within 2^-4 |top| of top has |v| <= (1 + 2^-4) |top|: a logit that
        # is not a candidate cannot exceed the exact value of the row's bf16 maximum
        cand = (y2 >= top - top.abs() * 0.0625 - 1e-6).nonzero()
        r, c = cand[:, 0], cand[:, 1]
        xr = xq.reshape(-1, self.in_features)[r].double()
        exact = (xr * self._w_exact[c].to(torch.bfloat16).double()).sum(-1)
        if self.bias is not None:
            exact = exact + self.bias[c].double()
        y2[r, c] = exact.float()
        return y


class Norm:
    """An RMSNorm module computed by `torch.nn.functional.rms_norm` (fewer dispatched ops), used only where it
    gives the module's own output bit for bit (checked on a probe at build time); otherwise the module runs."""

    def __init__(self, mod: nn.Module):
        self.mod = mod
        w = getattr(mod, "weight", None)
        self.eps = getattr(mod, "variance_epsilon", getattr(mod, "eps", None))
        self.w = w.detach() if isinstance(w, torch.Tensor) else None
        self.fast = False
        if self.w is not None and self.w.ndim == 1 and self.w.dtype == torch.float32 and isinstance(self.eps, float):
            g = torch.Generator(device="cpu").manual_seed(0)
            probe = (torch.randn(3, self.w.shape[0], generator=g) * 3).to(self.w.device)
            with torch.no_grad():
                self.fast = bool(torch.equal(self._rms(probe), mod(probe)))

    def _rms(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.w, self.eps)

    def __call__(self, x):
        return self._rms(x) if self.fast and x.dtype == torch.float32 else self.mod(x)


_GATED_MLPS = {"LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP", "GatedMLP"}


def _is_silu(mlp: nn.Module) -> bool:
    act = getattr(mlp, "act_fn", None)
    if act is None:
        return type(mlp).__name__ == "GatedMLP"        # ours: F.silu
    probe = torch.linspace(-6, 6, 97)
    with torch.no_grad():
        return isinstance(act, nn.Module) and torch.equal(act(probe), F.silu(probe))


class FusedLayer:
    """A Llama-style decoder layer prepared for the runtime's forward: one GEMM for q/k/v, one for gate/up,
    norms with fewer ops. `proj` holds q/k/v/o_proj (a target layer's self_attn, or a draft layer itself).
    Parts the plan does not recognise run through their modules (a non-gated MLP, a norm that differs)."""

    def __init__(self, layer: nn.Module, proj: nn.Module, compute: str, device, *, n_heads: int, n_kv: int,
                 head_dim: int, context_kv: bool = False):
        self.nq, self.nkv, self.hd = n_heads, n_kv, head_dim
        self.ln1 = Norm(layer.input_layernorm)
        self.ln2 = Norm(layer.post_attention_layernorm)
        self.qkv = Gemm([proj.q_proj, proj.k_proj, proj.v_proj], compute, device)
        # DFlash projects the target's context through k/v alone: a second fused GEMM over those two
        self.kv = Gemm([proj.k_proj, proj.v_proj], compute, device) if context_kv else None
        self.o = Gemm([proj.o_proj], compute, device)
        self.q_norm, self.k_norm = getattr(proj, "q_norm", None), getattr(proj, "k_norm", None)
        mlp = layer.mlp
        self.mlp = mlp
        self.gate_up = self.down = None
        if type(mlp).__name__ in _GATED_MLPS and _is_silu(mlp):
            self.gate_up = Gemm([mlp.gate_proj, mlp.up_proj], compute, device)
            self.down = Gemm([mlp.down_proj], compute, device)
            self.inter = int(mlp.gate_proj.out_features)

    def qkv_heads(self, x: torch.Tensor, cos, sin):
        """x [B, T, in] (normed) -> q [B, nq, T, D], k, v [B, nkv, T, D] with RoPE applied to q and k (and the
        per-head q/k norms first where the layer has them)."""
        B, T = x.shape[:2]
        nq, nkv = self.nq, self.nkv
        # bf16 mode: q/k reach float32 in RoPE's products with the float32 tables, v in the cache write (or
        # FP8 KV's qdq, which takes it as float32); only the per-head norms need float32 inputs
        qkv = (self.qkv(x) if self.q_norm is not None else self.qkv.promoting(x)).view(B, T, nq + 2 * nkv, self.hd)
        qk, v = qkv.split((nq + nkv, nkv), 2)
        if self.q_norm is not None:
            q, k = qk.split((nq, nkv), 2)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), 2)
        q, k = rope_heads(qk, cos, sin).split((nq, nkv), 2)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def finish(self, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Residual h [B, T, H] + o_proj(attention output o [B, nq, T, D]), then the MLP block."""
        B, T = h.shape[:2]
        h = h + self.o.promoting(o.transpose(1, 2).reshape(B, T, -1))
        x = self.ln2(h)
        if self.gate_up is None:
            return h + self.mlp(x)
        g, u = self.gate_up(x).split(self.inter, -1)
        return h + self.down.promoting(F.silu(g) * u)
