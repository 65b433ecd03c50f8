"""How `specpipe profile` calibrates the machine, from microbenchmarks that are *not* the step being predicted:

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
The result (a calibration dict) gives the achieved rates of a `costmodel.Machine` (`machine_from_calibration`);
several rounds merge into their best (`best_calibration`).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

from runtime.cost.costmodel import (
    Gemm,
    Machine,
    ModelShape,
    Precision,
    attention_cost,
    elementwise_bytes,
    forward_ops,
    gemm_op,
)
from runtime.cost.measure import (
    DEFAULT_ROWS,
    Matmul,
    Rotating,
    Stack,
    attention,
    last_level_cache_bytes,
    precision_for,
    rms_norm,
    silu_mul,
    timeit,
)


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


@dataclass(frozen=True)
class BenchSizes:
    """The calibration microbenchmarks' sizes: the KV length attention reads (`context`), the token rows of the GEMM
    peak, the batch and query length of the attention benchmark, the rows of the elementwise one, and the token rows
    of the GEMM-by-rows curve."""

    context: int = 512
    peak_rows: int = 1024
    attn_batch: int = 32
    attn_q: int = 8
    elem_rows: int = 256
    curve_rows: tuple = DEFAULT_ROWS


def calibrate(shape: ModelShape, gemm_dtype: str, device, sizes: BenchSizes = BenchSizes()) -> dict:
    """Achieved rates on this machine from microbenchmarks sized like the model (`sizes`) but separate from its step:
    GEMM peak, GEMV streaming bandwidth, attention and elementwise bandwidth (bytes as the cost model counts
    them; operands rotated through more memory than the last-level cache), and the fixed cost per modelled
    operation."""
    import torch

    context, attn_batch, attn_q = sizes.context, sizes.attn_batch, sizes.attn_q
    act = torch.bfloat16 if gemm_dtype in ("fp8", "bfloat16") else getattr(torch, gemm_dtype)
    b = _Microbench(gemm_dtype, device, torch.Generator().manual_seed(2), act, precision_for(gemm_dtype),
               last_level_cache_bytes(device))
    with torch.inference_mode():
        big = max(shape.layer_gemms, key=lambda g: g.k * g.n)
        peak, peak_gemms = _gemm_peak(b, shape, sizes.peak_rows)
        roof = _gemm_roofline(b, big, peak)
        footprints = _gemv_by_footprint(b, big, roof.x1, roof.w_bytes)
        curve = _gemm_by_rows(b, shape, sizes.curve_rows)
        meas, (attn_bw, attn_peak) = _attention(b, shape, context, attn_batch, attn_q)
        elem_bytes, t_elem = _elementwise(b, shape, sizes.elem_rows)
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
                                         "flops": m[1], "bytes": m[2]} for q_len, m in zip((1, attn_q), meas, strict=True)],
                          "elementwise": {"rows": sizes.elem_rows, "bytes": elem_bytes, "seconds": t_elem},
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

# ------------------------------------------------------------------------------------------ machine


def machine_from_calibration(cal: dict, gemm_dtype: str, name: str) -> Machine:
    return Machine(name, {gemm_dtype: cal["peak_tflops"] * 1e12}, cal["bandwidth_tb_s"] * 1e12,
                   cal["op_overhead_us"] * 1e-6, attn_bandwidth=cal["attn_bandwidth_tb_s"] * 1e12,
                   elem_bandwidth=cal["elem_bandwidth_tb_s"] * 1e12, attn_peak=cal["attn_tflops"] * 1e12,
                   overlap=cal["overlap"], attn_overlap=1.0, cache_bytes=cal["cache_bytes"],
                   cache_bandwidth=cal["cache_bandwidth_tb_s"] * 1e12,
                   gemm_row_factors=tuple((float(r), float(f)) for r, f in cal.get("gemm_row_factors") or ()),
                   footprint_bandwidth=tuple((float(w), float(b) * 1e12) for w, b in cal.get("footprint_bandwidth_tb_s") or ()))


def best_calibration(a: dict, b: dict, gemm_dtype: str) -> dict:
    out = dict(a)
    for k in ("peak_tflops", "bandwidth_tb_s", "attn_bandwidth_tb_s", "attn_tflops", "elem_bandwidth_tb_s",
              "cache_bandwidth_tb_s"):
        out[k] = max(a[k], b[k])
    out["overlap"] = min(a["overlap"], b["overlap"])
    out["op_overhead_us"] = min(a["op_overhead_us"], b["op_overhead_us"])
    # each GEMM call's fastest round; the factors are then taken against the merged machine
    curve = copy.deepcopy(a["benchmarks"]["gemm_by_rows"])
    for ca, cb in zip(curve, b["benchmarks"]["gemm_by_rows"], strict=True):
        for ga, gb in zip(ca["gemms"], cb["gemms"], strict=True):
            ga["seconds"] = min(ga["seconds"], gb["seconds"])
    foot = copy.deepcopy(a["benchmarks"]["gemv_by_footprint"])
    for fa, fb in zip(foot, b["benchmarks"]["gemv_by_footprint"], strict=True):
        fa["seconds"] = min(fa["seconds"], fb["seconds"])
    out["footprint_bandwidth_tb_s"] = _footprint_rates(foot, a["benchmarks"]["stream_gemv"]["bytes"])
    out["benchmarks"] = {**a["benchmarks"], "gemm_by_rows": curve, "gemv_by_footprint": foot}
    out["gemm_row_factors"] = gemm_row_factors(out, gemm_dtype)
    return out
