"""`specpipe profile`: measure the step time of a model's layer shapes on this machine and fit the cost model.

What is measured: a real chained forward of the model's shapes (per layer: fused q/k/v GEMM, attention over a
KV cache of `context` tokens, o_proj, RMSNorm, gate/up GEMM, SiLU x up, down_proj, residual adds; then
lm_head), random weights, for a range of token rows M = batch x q_len. On a CPU the GEMMs run in float32 (or
bfloat16); on a CUDA GPU in bfloat16, or FP8 through `torch._scaled_mm` where the GPU has FP8 tensor cores.

How the machine is calibrated, from microbenchmarks that are *not* the step being predicted:
- GEMM peak: each of the model's GEMM shapes at many rows (compute-bound), total FLOPs over total time;
- GEMM bandwidth: a one-row GEMV over the largest layer weight, rotated through copies larger than the cache;
- weight streaming by working set: the same GEMV cycling through 1/8 to 4x the cache's size of weights (how
  much of a step's working set the cache really keeps);
- GEMM efficiency by row count: the model's GEMM shapes at each profiled M, weights cycled through the model's
  own footprint; measured / modelled time is a factor on every GEMM with that many rows;
- attention and elementwise bandwidth: one layer's decode attention (at 1 and 8 query rows, solved for its
  KV-streaming rate and arithmetic rate), and one layer's norms/adds/SiLU, with bytes counted exactly as the
  cost model counts them (these are the efficiency factors of those kernels);
- per-operation overhead: the same forward on a width-16 miniature of the model, divided by its op count.
The profile file holds these achieved rates (`machine`), which `tune` uses instead of the datasheet when
`hardware.profile` points at it, and every measured point with the model's prediction.
"""
from __future__ import annotations

import copy
import math
import platform
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from runtime.cost.costmodel import (
    Gemm,
    Machine,
    ModelShape,
    Precision,
    attention_cost,
    elementwise_bytes,
    forward_ops,
    gemm_op,
    step_time,
)

FORMAT = "specpipe.hardware-profile/1"
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
        for layer, (k_cache, v_cache) in zip(self.layers, kv):
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


# ------------------------------------------------------------------------------------------ calibration


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


@dataclass
class _Microbench:
    """What every calibration microbenchmark shares: the GEMM dtype and device, one seeded generator that draws
    all operands in turn (so the order of the benchmarks fixes every value), the precision, the cache size."""

    gemm_dtype: str
    device: object
    gen: object
    act: object                 # torch dtype of the activations
    prec: Precision
    cache: int

    def rnd(self, *sz):
        import torch

        return torch.randn(*sz, generator=self.gen).to(self.device, self.act)

    def matmul(self, k: int, n: int) -> Matmul:
        return Matmul(k, n, self.gemm_dtype, self.device, self.gen)

    def time(self, fn) -> float:
        return timeit(fn, self.device)


@dataclass
class _Roofline:
    """The largest layer GEMM as a one-row GEMV streaming its weight, from cache, and at its ridge row count."""

    x1: object                  # the one-row input (the footprint sweep reuses it)
    w_bytes: int
    t_bw: float
    t_hot: float
    ridge: int
    t_knee: float
    ratio: float
    overlap: float

    @property
    def bandwidth(self) -> float:
        return self.w_bytes / self.t_bw


def calibrate(shape: ModelShape, gemm_dtype: str, device, *, context: int = 512, peak_rows: int = 1024,
              attn_batch: int = 32, attn_q: int = 8, elem_rows: int = 256, curve_rows=DEFAULT_ROWS) -> dict:
    """Achieved rates on this machine from microbenchmarks sized like the model but separate from its step:
    GEMM peak, GEMV streaming bandwidth, attention and elementwise bandwidth (bytes as the cost model counts
    them; operands rotated through more memory than the last-level cache), and the fixed cost per modelled
    operation."""
    import torch

    act = torch.bfloat16 if gemm_dtype in ("fp8", "bfloat16") else getattr(torch, gemm_dtype)
    b = _Microbench(gemm_dtype, device, torch.Generator().manual_seed(2), act, precision_for(gemm_dtype),
               last_level_cache_bytes(device))
    with torch.inference_mode():
        big = max(shape.layer_gemms, key=lambda g: g.k * g.n)
        peak, peak_gemms = _gemm_peak(b, shape, peak_rows)
        roof = _gemm_roofline(b, big, peak)
        footprints = _gemv_by_footprint(b, big, roof.x1, roof.w_bytes)
        curve = _gemm_by_rows(b, shape, curve_rows)
        meas, (attn_bw, attn_peak) = _attention(b, shape, context, attn_batch, attn_q)
        elem_bytes, t_elem = _elementwise(b, shape, elem_rows)
        n_ops, t_mini = _miniature_forward(b, shape)
    w_bytes = roof.w_bytes
    cal = {"peak_tflops": peak / 1e12, "bandwidth_tb_s": roof.bandwidth / 1e12, "overlap": roof.overlap,
           "cache_bytes": b.cache, "cache_bandwidth_tb_s": w_bytes / roof.t_hot / 1e12,
           "attn_bandwidth_tb_s": attn_bw / 1e12, "attn_tflops": attn_peak / 1e12,
           "elem_bandwidth_tb_s": elem_bytes / t_elem / 1e12,
           "op_overhead_us": t_mini / n_ops * 1e6,
           "footprint_bandwidth_tb_s": _footprint_rates(footprints, w_bytes),
           "benchmarks": {"peak_gemms": peak_gemms,
                          "stream_gemv": {"k": big.k, "n": big.n, "bytes": w_bytes, "seconds": roof.t_bw},
                          "gemm_at_ridge": {"rows": roof.ridge, "seconds": roof.t_knee, "over_roofline": roof.ratio},
                          "gemv_by_footprint": footprints, "gemm_by_rows": curve,
                          "attention": [{"batch": attn_batch, "q_len": q_len, "context": context, "seconds": m[0],
                                         "flops": m[1], "bytes": m[2]} for q_len, m in zip((1, attn_q), meas)],
                          "elementwise": {"rows": elem_rows, "bytes": elem_bytes, "seconds": t_elem},
                          "miniature_forward": {"ops": n_ops, "seconds": t_mini}}}
    cal["gemm_row_factors"] = gemm_row_factors(cal, gemm_dtype)
    return cal


def _gemm_peak(b: _Microbench, shape: ModelShape, peak_rows: int) -> tuple[float, list[dict]]:
    """Peak: every distinct GEMM shape of the model with many rows (compute-bound); the achieved rate of the
    model's GEMM mix is their total FLOPs over their total time."""
    flops = secs = 0.0
    peak_gemms = []
    for k, n in gemm_shapes(shape):
        mm = b.matmul(k, n)
        x = b.rnd(peak_rows, k)
        t = b.time(lambda mm=mm, x=x: mm(x))
        flops, secs = flops + 2.0 * peak_rows * k * n, secs + t
        peak_gemms.append({"rows": peak_rows, "k": k, "n": n, "seconds": t})
        del mm, x
    return flops / secs, peak_gemms


def _gemm_roofline(b: _Microbench, big: Gemm, peak: float) -> _Roofline:
    # GEMM bandwidth: one row through the largest layer GEMM's weight, weights rotated (memory-bound).
    x1 = b.rnd(1, big.k)
    w_bytes = big.k * big.n * b.prec.weight_bytes
    rot = Rotating(lambda: (b.matmul(big.k, big.n),), w_bytes, b.cache)
    t_bw = b.time(rot(lambda m: m(x1)))
    bandwidth = w_bytes / t_bw
    hot_mm = rot.sets[0][0]
    t_hot = b.time(lambda: hot_mm(x1))   # the same weight again and again: served from cache

    # GEMM knee: the largest GEMM at its ridge row count, where memory and compute time are equal: the
    # roofline says max() = either; a kernel that cannot overlap them takes twice that, or more.
    ridge = max(1, round(peak / bandwidth * b.prec.weight_bytes / 2))
    xr = b.rnd(ridge, big.k)
    t_knee = b.time(rot(lambda m: m(xr)))
    roof = max(w_bytes / bandwidth, 2.0 * ridge * big.k * big.n / peak)
    ratio = t_knee / roof
    # (2 a^p)^(1/p) = ratio x a. p < 1 means worse than adding them up (small-M kernels that waste compute).
    overlap = math.inf if ratio < 1.02 else max(0.5, math.log(2) / math.log(min(ratio, 4.0)))
    return _Roofline(x1, w_bytes, t_bw, t_hot, ridge, t_knee, ratio, overlap)


def _gemv_by_footprint(b: _Microbench, big: Gemm, x1, w_bytes: int) -> list[dict]:
    """Weight streaming by working set: the same one-row GEMV cycling through copies of the weight that add up
    to W bytes, for W from a fraction of the cache to 4x it (how much of a working set the cache keeps)."""
    footprints = []
    for frac in (1 / 8, 1 / 4, 1 / 2, 3 / 4, 1, 3 / 2, 2, 4):
        rot = Rotating(lambda: (b.matmul(big.k, big.n),), w_bytes, frac * b.cache / 3)
        ws = len(rot.sets) * w_bytes
        if not footprints or ws > footprints[-1]["bytes"]:
            footprints.append({"bytes": ws, "copies": len(rot.sets), "seconds": b.time(rot(lambda m: m(x1)))})
        del rot
    return footprints


def _gemm_by_rows(b: _Microbench, shape: ModelShape, curve_rows) -> list[dict]:
    """GEMM efficiency by row count: every distinct GEMM shape of the model at each row count of the profile,
    its weight rotated through as many copies as the model holds weights (capped at 3x the cache: beyond
    that every call streams from memory anyway), so that each call finds the cache as a step would."""
    footprint = min(shape.weight_params() * b.prec.weight_bytes, 3 * b.cache)
    curve = []
    for rows in curve_rows:
        parts = []
        for k, n in gemm_shapes(shape):
            rot = Rotating(lambda k=k, n=n: (b.matmul(k, n),), k * n * b.prec.weight_bytes, footprint / 3)
            xm = b.rnd(rows, k)
            parts.append({"k": k, "n": n, "copies": len(rot.sets), "seconds": b.time(rot(lambda m, xm=xm: m(xm)))})
            del rot, xm
        curve.append({"rows": rows, "gemms": parts})
    return curve


def _attention(b: _Microbench, shape: ModelShape, context: int, attn_batch: int, attn_q: int):
    """One layer's attention for attn_batch sequences over `context` tokens, with 1 query row per sequence
    (streams the KV cache) and with `attn_q` rows (does attn_q times the arithmetic). Returns the measurements
    (seconds, flops, bytes) and the KV-streaming and arithmetic rates solved from them."""
    kv_shape = (attn_batch, shape.kv_heads, context + attn_q, shape.head_dim)
    rot_kv = Rotating(lambda: (b.rnd(*kv_shape), b.rnd(*kv_shape)),
                      attention_cost(shape, attn_batch, 1, context, b.prec)[1], b.cache)
    gqa = shape.heads != shape.kv_heads
    meas = []
    for q_len in (1, attn_q):
        q = b.rnd(attn_batch, shape.heads, q_len, shape.head_dim)
        t = b.time(rot_kv(lambda kc, vc, q=q: attention(q, kc, vc, gqa)))
        meas.append((t, *attention_cost(shape, attn_batch, q_len, context + attn_q - q_len, b.prec)))
    return meas, _solve_attention(meas)


def _elementwise(b: _Microbench, shape: ModelShape, elem_rows: int) -> tuple[float, float]:
    """One layer's norms, residual adds and SiLU x up on elem_rows rows: (bytes as the cost model counts them,
    seconds)."""
    inter = next(g.n for g in shape.layer_gemms if g.name == "gate_up_proj") // 2
    elem_bytes = elementwise_bytes(shape, elem_rows, b.prec)

    def elementwise(xh, gu):
        y = xh + rms_norm(xh)
        return y + rms_norm(y), silu_mul(gu)

    rot = Rotating(lambda: (b.rnd(elem_rows, shape.hidden), b.rnd(elem_rows, 2 * inter)), elem_bytes, b.cache)
    return elem_bytes, b.time(rot(elementwise))


def _miniature_forward(b: _Microbench, shape: ModelShape) -> tuple[int, float]:
    """Fixed cost: the same forward on a miniature of the model (every call, no arithmetic to speak of):
    (modelled ops, seconds)."""
    mini = miniature(shape)
    fn = Stack(mini, b.gemm_dtype, b.device).prepare(1, 1, 1)
    t_mini = b.time(fn)
    return sum(op.count for op in forward_ops(mini, batch=1, q_len=1, context=1, prec=b.prec)), t_mini


def _footprint_rates(footprints: list[dict], w_bytes: float) -> list[list[float]]:
    """[working-set bytes, TB/s] of the GEMV cycling through that many bytes of weights."""
    return [[f["bytes"], w_bytes / f["seconds"] / 1e12] for f in footprints]


def gemm_shapes(shape: ModelShape) -> list[tuple[int, int]]:
    return sorted({(g.k, g.n) for g in (*shape.layer_gemms, *shape.head_gemms, *shape.input_gemms)})


def gemm_row_factors(cal: dict, gemm_dtype: str) -> list[list[float]]:
    """[rows, factor] for each measured row count: the GEMMs' total measured time over the cost model's time
    for the same calls on the calibrated machine (roofline with the overlap and cache terms, no factor)."""
    prec = precision_for(gemm_dtype)
    base = machine_from_calibration({**cal, "gemm_row_factors": [], "op_overhead_us": 0.0}, gemm_dtype, "calibration")
    out = []
    for c in cal["benchmarks"]["gemm_by_rows"]:
        meas = model = 0.0
        for g in c["gemms"]:
            op = gemm_op(Gemm("probe", g["k"], g["n"]), c["rows"], prec, 1)
            ws = g["copies"] * op.bytes
            bw = base.weight_bandwidth(ws)
            hot = max(0.0, 1.0 - ws / base.cache_bytes) if base.cache_bytes and bw is None else 0.0
            meas, model = meas + g["seconds"], model + op.time(base, hot, bw)
        out.append([c["rows"], meas / model])
    return out


def _solve_attention(meas) -> tuple[float, float]:
    """Attention bandwidth and FLOP rate such that the cost model with additive attention (attn_overlap 1)
    reproduces both measured attention times [(seconds, flops, bytes) with 1 and with several query rows]:
    t = bytes / bw + flops / peak at both points, two linear equations in 1/bw and 1/peak. Where the two
    points cannot separate them (noise makes a term negative) the other term takes the whole time."""
    (t1, f1, b1), (tq, fq, bq) = meas
    det = b1 * fq - bq * f1
    inv_bw = (t1 * fq - tq * f1) / det if det else 0.0
    inv_pk = (b1 * tq - bq * t1) / det if det else 0.0
    unlimited = 1e30   # finite, so that the profile stays plain JSON
    if inv_bw <= 0:
        return unlimited, fq / tq
    if inv_pk <= 0:
        return b1 / t1, unlimited
    return 1 / inv_bw, 1 / inv_pk


def miniature(shape: ModelShape) -> ModelShape:
    """The same layer structure at width 16: its forward costs only the calls themselves."""
    scale = {g.name: g for g in shape.layer_gemms}
    qkv_mult = scale["qkv_proj"].k // shape.hidden
    heads, kv_heads, hd, hid = 2, 2 if shape.heads == shape.kv_heads else 1, 8, 16
    layer = (Gemm("qkv_proj", hid * qkv_mult, (heads + 2 * kv_heads) * hd), Gemm("o_proj", heads * hd, hid),
             Gemm("gate_up_proj", hid, 32), Gemm("down_proj", 16, hid))
    return ModelShape("miniature", shape.num_layers, hid, heads, kv_heads, hd, layer,
                      head_gemms=tuple(Gemm(g.name, hid, 16, g.split) for g in shape.head_gemms),
                      input_gemms=tuple(Gemm(g.name, 16, hid, g.split) for g in shape.input_gemms))


# ------------------------------------------------------------------------------------------ profile


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


def predict(points: list[dict], shape: ModelShape, machine: Machine, prec: Precision) -> list[dict]:
    for p in points:
        ops = forward_ops(shape, batch=p["batch"], q_len=p["q_len"], context=p["context"], prec=prec)
        p["predicted_ms"] = step_time(ops, machine) * 1e3
        p["error"] = p["predicted_ms"] / p["measured_ms"] - 1
    return points


def machine_from_calibration(cal: dict, gemm_dtype: str, name: str) -> Machine:
    return Machine(name, {gemm_dtype: cal["peak_tflops"] * 1e12}, cal["bandwidth_tb_s"] * 1e12,
                   cal["op_overhead_us"] * 1e-6, attn_bandwidth=cal["attn_bandwidth_tb_s"] * 1e12,
                   elem_bandwidth=cal["elem_bandwidth_tb_s"] * 1e12, attn_peak=cal["attn_tflops"] * 1e12,
                   overlap=cal["overlap"], attn_overlap=1.0, cache_bytes=cal["cache_bytes"],
                   cache_bandwidth=cal["cache_bandwidth_tb_s"] * 1e12,
                   gemm_row_factors=tuple((float(r), float(f)) for r, f in cal.get("gemm_row_factors") or ()),
                   footprint_bandwidth=tuple((float(w), float(b) * 1e12) for w, b in cal.get("footprint_bandwidth_tb_s") or ()))


def device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"cpu:{platform.processor() or platform.machine()}"


def profile(shapes: dict[str, ModelShape], *, device, gemm_dtype: str, rows=DEFAULT_ROWS, context: int = 512,
            q_lens=(1, 4), rounds: int = 3, progress=None) -> dict:
    """Calibrate on the first shape (the target), measure every shape, predict every point, summarise.

    The whole measurement is repeated `rounds` times and each quantity keeps its best round (highest rate,
    lowest time): on a shared machine a burst of other work can last longer than one point's repetitions."""
    import torch

    first = next(iter(shapes.values()))
    cal: dict = {}
    measured: dict[str, list[dict]] = {}
    for r in range(rounds):
        c = calibrate(first, gemm_dtype, device, context=context, curve_rows=rows)
        cal = c if not cal else _best_calibration(cal, c, gemm_dtype)
        for key, shape in shapes.items():
            pts: list[dict] = []
            for q in q_lens:
                pts += measure(shape, gemm_dtype, device, rows=rows, q_len=q, context=context,
                               progress=(lambda m, t, key=key, q=q, r=r: progress(r, key, q, m, t)) if progress else None)
            if key not in measured:
                measured[key] = pts
            else:
                for old, new in zip(measured[key], pts):
                    old["measured_ms"] = min(old["measured_ms"], new["measured_ms"])
    name = device_name(device)
    machine = machine_from_calibration(cal, gemm_dtype, name)
    prec = precision_for(gemm_dtype)
    models = {}
    for key, shape in shapes.items():
        pts = predict(measured[key], shape, machine, prec)
        models[key] = {"shape": _shape_doc(shape), "points": pts,
                       "max_abs_error": max(abs(p["error"]) for p in pts),
                       "mean_abs_error": sum(abs(p["error"]) for p in pts) / len(pts)}
    ridge = machine.peak(gemm_dtype) / machine.bandwidth * prec.weight_bytes / 2
    return {
        "format": FORMAT,
        "device": name,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "rounds": rounds,
        "gemm_dtype": gemm_dtype,
        "context": context,
        "machine": {"peak_tflops": {gemm_dtype: cal["peak_tflops"]}, "bandwidth_tb_s": cal["bandwidth_tb_s"],
                    "attn_bandwidth_tb_s": cal["attn_bandwidth_tb_s"], "attn_tflops": cal["attn_tflops"],
                    "elem_bandwidth_tb_s": cal["elem_bandwidth_tb_s"], "overlap": cal["overlap"], "attn_overlap": 1.0,
                    "cache_bytes": cal["cache_bytes"], "cache_bandwidth_tb_s": cal["cache_bandwidth_tb_s"],
                    "op_overhead_us": cal["op_overhead_us"], "gemm_row_factors": cal["gemm_row_factors"],
                    "footprint_bandwidth_tb_s": cal["footprint_bandwidth_tb_s"],
                    "link_gb_s": None},
        "ridge_rows": ridge,
        "calibration": cal,
        "models": models,
        "max_abs_error": max(m["max_abs_error"] for m in models.values()),
        "mean_abs_error": sum(m["mean_abs_error"] for m in models.values()) / len(models),
    }


def _best_calibration(a: dict, b: dict, gemm_dtype: str) -> dict:
    out = dict(a)
    for k in ("peak_tflops", "bandwidth_tb_s", "attn_bandwidth_tb_s", "attn_tflops", "elem_bandwidth_tb_s",
              "cache_bandwidth_tb_s"):
        out[k] = max(a[k], b[k])
    out["overlap"] = min(a["overlap"], b["overlap"])
    out["op_overhead_us"] = min(a["op_overhead_us"], b["op_overhead_us"])
    # each GEMM call's fastest round; the factors are then taken against the merged machine
    curve = copy.deepcopy(a["benchmarks"]["gemm_by_rows"])
    for ca, cb in zip(curve, b["benchmarks"]["gemm_by_rows"]):
        for ga, gb in zip(ca["gemms"], cb["gemms"]):
            ga["seconds"] = min(ga["seconds"], gb["seconds"])
    foot = copy.deepcopy(a["benchmarks"]["gemv_by_footprint"])
    for fa, fb in zip(foot, b["benchmarks"]["gemv_by_footprint"]):
        fa["seconds"] = min(fa["seconds"], fb["seconds"])
    out["footprint_bandwidth_tb_s"] = _footprint_rates(foot, a["benchmarks"]["stream_gemv"]["bytes"])
    out["benchmarks"] = {**a["benchmarks"], "gemm_by_rows": curve, "gemv_by_footprint": foot}
    out["gemm_row_factors"] = gemm_row_factors(out, gemm_dtype)
    return out


def _shape_doc(s: ModelShape) -> dict:
    return {"num_layers": s.num_layers, "hidden": s.hidden, "heads": s.heads, "kv_heads": s.kv_heads,
            "head_dim": s.head_dim, "gemms": [[g.name, g.k, g.n] for g in (*s.layer_gemms, *s.input_gemms, *s.head_gemms)],
            "weight_params": s.weight_params()}


def check_profile(doc: dict) -> list[str]:
    """Problems that make a profile file unusable (empty when fine)."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        return [f"not a specpipe hardware profile (expected format '{FORMAT}'); write one with `specpipe profile CONFIG`"]
    m = doc.get("machine") or {}
    probs = []
    if not isinstance(m.get("peak_tflops"), dict) or not m["peak_tflops"] or any(
            not isinstance(v, (int, float)) or v <= 0 for v in m["peak_tflops"].values()):
        probs.append("machine.peak_tflops must map a GEMM dtype to a positive TFLOP/s")
    for k in ("bandwidth_tb_s", "op_overhead_us"):
        if not isinstance(m.get(k), (int, float)) or m[k] < 0 or (k == "bandwidth_tb_s" and m[k] == 0):
            probs.append(f"machine.{k} must be a positive number")
    for k, what in (("gemm_row_factors", "[rows, factor]"), ("footprint_bandwidth_tb_s", "[bytes, TB/s]")):
        curve = m.get(k)
        if curve is None:
            continue
        ok = isinstance(curve, list) and all(
            isinstance(pt, list) and len(pt) == 2 and all(isinstance(v, (int, float)) and v > 0 for v in pt) for pt in curve)
        if not ok or [pt[0] for pt in curve] != sorted({pt[0] for pt in curve}):
            probs.append(f"machine.{k} must be a list of {what} pairs of positive numbers, strictly increasing in the first")
    return probs




# ------------------------------------------------------------------------------------------ `specpipe profile`


def shapes_from_artifacts(target: dict, draft: dict | None = None, draft_config: dict | None = None) -> dict[str, ModelShape]:
    """The target's (and, once trained, the draft's) shapes from `target.json` and `draft.json` + the draft's
    `config.json` (the caller reads them: `pipeline.artifacts`)."""
    from runtime.cost.costmodel import draft_shape, target_shape

    shapes = {"target": target_shape(target)}
    if draft is not None and draft_config is not None:
        shapes["draft"] = draft_shape(draft, draft_config, target["hidden_size"])
    return shapes


def resolve_device_dtype(device_opt: str, dtype_opt: str):
    """`auto` -> CUDA when present; GEMM dtype `auto` -> FP8 on GPUs with FP8 tensor cores (sm89+), BF16 on
    other GPUs, float32 on a CPU (its float32 GEMMs are the fast, well-defined path)."""
    import torch

    from runtime.errors import RuntimeUsageError

    if device_opt == "cuda" and not torch.cuda.is_available():
        raise RuntimeUsageError("run.device is cuda but no CUDA device is visible")
    dev = torch.device("cuda" if device_opt in ("cuda", "auto") and torch.cuda.is_available() else "cpu")
    if dtype_opt == "auto":
        if dev.type == "cuda":
            dtype_opt = "fp8" if torch.cuda.get_device_capability(dev) >= (8, 9) else "bfloat16"
        else:
            dtype_opt = "float32"
    if dtype_opt == "fp8" and dev.type != "cuda":
        raise RuntimeUsageError("--dtype fp8 needs a CUDA GPU with FP8 tensor cores (torch._scaled_mm)")
    return dev, dtype_opt
