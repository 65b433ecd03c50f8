"""The timing harness of `specpipe profile`: a model's shapes as a real chained forward, timed on this machine.

What is measured: per layer, fused q/k/v GEMM, attention over a KV cache of `context` tokens, o_proj, RMSNorm,
gate/up GEMM, SiLU x up, down_proj, residual adds; then lm_head; random weights, for a range of token rows
M = batch x q_len. On a CPU the GEMMs run in float32 (or bfloat16); on a CUDA GPU in bfloat16, or FP8 through
`torch._scaled_mm` where the GPU has FP8 tensor cores. Also here: the building blocks the calibration's
microbenchmarks (runtime.cost.calibrate) time, the last-level cache size, and operands rotated through more
memory than that cache.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

from runtime.cost.costmodel import ModelShape, Precision

DEFAULT_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timeit(fn, device, *, reps: int = 9) -> float:
    """Fastest of `reps` calls after two warm-up calls. The minimum, not the median: other processes on a shared
    machine only ever add time. The same number of samples for every measurement, microbenchmark or whole step,
    so that all of them are the same order statistic of the same noise (a minimum over thousands of short calls
    would find quiet moments a minimum over a few long steps cannot)."""
    fn()
    fn()
    _sync(device)
    times: list[float] = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)


class Matmul:
    """y = x @ W for a K x N weight, in the profile's GEMM dtype (FP8 via torch._scaled_mm on CUDA)."""

    def __init__(self, k: int, n: int, gemm_dtype: str, device, gen):
        import torch

        self.k, self.n = k, n
        self.fp8 = gemm_dtype == "fp8"
        self.dtype = torch.bfloat16 if self.fp8 else getattr(torch, gemm_dtype)
        if device.type == "cuda":   # billions of weights: draw them where they live
            w = torch.randn(n, k, device=device, dtype=torch.float32) * k ** -0.5
        else:
            w = torch.randn(n, k, generator=gen, dtype=torch.float32) * k ** -0.5
        if self.fp8:
            # _scaled_mm wants A row-major and B column-major: keep W as N x K row-major and pass W.t().
            self.w = w.to(device=device, dtype=torch.float8_e4m3fn)
            self.scale = torch.ones((), device=device)
        else:
            self.w = w.t().contiguous().to(device=device, dtype=self.dtype)

    def __call__(self, x):
        import torch

        if self.fp8:   # activations are quantized per tensor on the way in (already FP8: used as they are)
            xq = x if x.dtype == torch.float8_e4m3fn else x.to(torch.float8_e4m3fn)
            return torch._scaled_mm(xq, self.w.t(), scale_a=self.scale, scale_b=self.scale, out_dtype=torch.bfloat16)
        return x @ self.w


class Stack:
    """A model's shapes as a runnable forward (random weights; what is timed is the arithmetic, not the answer)."""

    def __init__(self, shape: ModelShape, gemm_dtype: str, device, seed: int = 0):
        import torch

        self.shape, self.device = shape, device
        self.act = torch.bfloat16 if gemm_dtype in ("fp8", "bfloat16") else getattr(torch, gemm_dtype)
        gen = torch.Generator().manual_seed(seed)
        self.layers = [{g.name: Matmul(g.k, g.n, gemm_dtype, device, gen) for g in shape.layer_gemms}
                       for _ in range(shape.num_layers)]
        self.heads = [Matmul(g.k, g.n, gemm_dtype, device, gen) for g in shape.head_gemms]
        self.inputs = [Matmul(g.k, g.n, gemm_dtype, device, gen) for g in shape.input_gemms]
        self.qkv_in = next(g.k for g in shape.layer_gemms if g.name == "qkv_proj")

    def prepare(self, batch: int, q_len: int, context: int):
        import torch

        s = self.shape
        rows = batch * q_len
        g = torch.Generator(self.device).manual_seed(1)   # KV caches can be GBs: drawn where they live
        rnd = lambda *sz: torch.randn(*sz, generator=g, device=self.device).to(self.act)  # noqa: E731
        kv = [rnd(2, batch, s.kv_heads, context + q_len, s.head_dim) for _ in range(s.num_layers)]
        x = rnd(rows, s.hidden)
        feats = rnd(rows, self.inputs[0].k) if self.inputs else None
        return lambda: self.forward(x, feats, kv, batch, q_len)

    def forward(self, x, feats, kv, batch: int, q_len: int):
        s = self.shape
        if feats is not None:
            for m in self.inputs:
                x = m(feats)
        q_dim = s.heads * s.head_dim
        for layer, (k_cache, v_cache) in zip(self.layers, kv, strict=True):
            h = rms_norm(x)
            if self.qkv_in != s.hidden:  # EAGLE-3's first layer reads [embedding, hidden]
                h = torch_cat([h] * (self.qkv_in // s.hidden))
            qkv = layer["qkv_proj"](h)
            q = qkv[:, :q_dim].reshape(batch, q_len, s.heads, s.head_dim).transpose(1, 2)
            # The new rows' K/V would be written into the cache; the cache already has room for them.
            a = attention(q, k_cache, v_cache, s.heads != s.kv_heads)
            x = x + layer["o_proj"](a.transpose(1, 2).reshape(batch * q_len, q_dim))
            x = x + layer["down_proj"](silu_mul(layer["gate_up_proj"](rms_norm(x))))
        for m in self.heads:
            x = m(x)
        return x


def rms_norm(x):
    import torch

    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)


def silu_mul(gu):
    import torch.nn.functional as F

    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate) * up


def attention(q, k_cache, v_cache, gqa: bool):
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(q, k_cache, v_cache, enable_gqa=gqa)


def torch_cat(xs):
    import torch

    return torch.cat(xs, dim=-1)


def precision_for(gemm_dtype: str) -> Precision:
    """What the measured stack moves per element (the profile's own dtype, not the deployment's)."""
    b = {"fp8": 1, "bfloat16": 2, "float16": 2, "float32": 4}[gemm_dtype]
    act = 2 if gemm_dtype in ("fp8", "bfloat16", "float16") else 4
    return Precision(gemm_dtype=gemm_dtype, weight_bytes=b, kv_bytes=act, act_bytes=act,
                     attn_dtype="bf16" if act == 2 else gemm_dtype)

# ------------------------------------------------------------------------------------------ working sets


def last_level_cache_bytes(device) -> int:
    """Size of the cache a working set must exceed to be streamed from memory (CPU L3 / GPU L2)."""
    import torch

    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20))
    best = 0
    for idx in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            txt = (idx / "size").read_text().strip().upper()
            best = max(best, int(txt[:-1]) * {"K": 1 << 10, "M": 1 << 20,
                                              "G": 1 << 30}[txt[-1]] if txt[-1] in "KMG" else int(txt))
        except (OSError, ValueError, KeyError):
            continue
    return best or (32 << 20)


class Rotating:
    """Calls fn on one of several copies of its operands in turn, so that together they exceed the last-level
    cache and every call streams from memory, as a real step does (weights and KV of all layers never stay
    cached between steps on a GPU; on a CPU they do only while the whole step fits in L3)."""

    def __init__(self, make, nbytes: int, cache_bytes: int):
        self.sets = [make() for _ in range(max(2, math.ceil(3 * cache_bytes / max(1, nbytes))))]
        self.i = 0

    def __call__(self, fn):
        def call():
            self.i = (self.i + 1) % len(self.sets)
            return fn(*self.sets[self.i])
        return call

# ------------------------------------------------------------------------------------------ step time


def measure(shape: ModelShape, gemm_dtype: str, device, *, rows=DEFAULT_ROWS, q_len: int = 1, context: int = 512,
            progress=None) -> list[dict]:
    """Measured step time for each M = batch x q_len (batch = M / q_len)."""
    stack = Stack(shape, gemm_dtype, device)
    out = []
    for m in rows:
        if m % q_len:
            continue
        batch = m // q_len
        fn = stack.prepare(batch, q_len, context)
        import torch

        with torch.inference_mode():
            t = timeit(fn, device)
        out.append({"rows": m, "batch": batch, "q_len": q_len, "context": context, "measured_ms": t * 1e3})
        if progress:
            progress(m, t)
    return out
