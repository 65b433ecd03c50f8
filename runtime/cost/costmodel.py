"""Roofline cost model of one decoding step of a target and its draft.

Pure functions, no torch: `tune` prices a deployment with them (runtime.cost.tuning), the draft-length optimiser
(runtime.cost.draft_length) compares step times at each draft length, `build` may reuse them, and
`specpipe profile` compares them with measured step times.

The model (anchors.md, "Formulas"):
- every GEMM with M token rows and a K x N weight does 2 M K N FLOPs and moves K N weight bytes plus the
  activations; attention reads each sequence's KV cache once per step (all of its 1+k query rows share it)
  and does 4 q L heads head_dim FLOPs per sequence; tensor parallelism splits weights, heads and KV;
- an operation takes max(bytes / bandwidth, FLOPs / peak) plus a fixed launch overhead, with bandwidth and
  peak the *achieved* values (datasheet x efficiency, or measured by `specpipe profile`). A measured profile
  may refine this with what it measured: separate attention/elementwise rates, how far memory and compute
  time overlap in one kernel (`Machine.overlap`; max() is full overlap) and a last-level-cache term for steps
  small enough to stay cached (a tiny model on a CPU); the datasheet model uses none of them;
- a step is the sum over its operations (layers are identical, so one layer is costed and multiplied).

One verification step with draft length k at batch B costs T_target(B, 1+k) + T_draft(B, k) (`Deployment`).
EAGLE-3 drafts serially (one pass over the 1+k verified rows, then k-1 one-row passes); DFlash drafts all k
positions in one parallel pass.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runtime.algorithms.registry import get as get_algorithm

if TYPE_CHECKING:
    from runtime.records import DraftInfo, TargetInfo

# ------------------------------------------------------------------------------------------ shapes


@dataclass(frozen=True)
class Gemm:
    name: str
    k: int          # input features
    n: int          # output features
    split: bool = True  # sharded by tensor parallelism (column/row parallel); False = replicated


@dataclass(frozen=True)
class ModelShape:
    """What one forward pass of a decoder costs: per-layer GEMMs, attention geometry, once-per-step GEMMs."""

    name: str
    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    layer_gemms: tuple[Gemm, ...]
    head_gemms: tuple[Gemm, ...] = ()     # lm_head (rows = logits rows)
    input_gemms: tuple[Gemm, ...] = ()    # e.g. EAGLE-3 / DFlash `fc` over target features (rows = input rows)

    def weight_params(self) -> int:
        return (self.num_layers * sum(g.k * g.n for g in self.layer_gemms)
                + sum(g.k * g.n for g in self.head_gemms) + sum(g.k * g.n for g in self.input_gemms))

    def kv_bytes_per_token(self, kv_bytes: float) -> float:
        """Bytes of KV cache one token occupies (all layers, K and V)."""
        return 2 * self.num_layers * self.kv_heads * self.head_dim * kv_bytes


def llama_layer_gemms(hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                      qkv_in: int | None = None) -> tuple[Gemm, ...]:
    qkv_in = qkv_in or hidden
    return (
        Gemm("qkv_proj", qkv_in, (heads + 2 * kv_heads) * head_dim),
        Gemm("o_proj", heads * head_dim, hidden),
        Gemm("gate_up_proj", hidden, 2 * intermediate),
        Gemm("down_proj", intermediate, hidden),
    )


def llama(name: str, *, num_layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int, vocab: int,
          head_dim: int | None = None) -> ModelShape:
    hd = head_dim or hidden // heads
    return ModelShape(name, num_layers, hidden, heads, kv_heads, hd,
                      llama_layer_gemms(hidden, heads, kv_heads, hd, intermediate),
                      head_gemms=(Gemm("lm_head", hidden, vocab),))


def target_shape(t: TargetInfo) -> ModelShape:
    """From the target stage's `target.json` (RuntimeFailure naming what it lacks)."""
    if not t.num_attention_heads or not t.intermediate_size:
        from runtime.errors import RuntimeFailure

        raise RuntimeFailure("target.json lacks num_attention_heads or intermediate_size, which the cost model prices; "
                         "rerun the target stage")
    return llama("target", num_layers=t.num_layers, hidden=t.hidden_size, heads=t.num_attention_heads,
                 kv_heads=t.num_key_value_heads, intermediate=t.intermediate_size,
                 vocab=t.vocab_size, head_dim=t.head_dim)


def draft_shape(draft: DraftInfo, cfg: dict, target_hidden: int) -> ModelShape:
    """From `draft.json` and the exported draft's `config.json` (the HF config, as a dict).

    EAGLE-3: `fc` maps the concatenated aux hidden states (n_aux x hidden) to hidden; the first layer's q/k/v
    read [embedding, hidden] (2 x hidden); lm_head over the draft vocabulary. DFlash: `fc` maps the
    concatenated target-layer features to hidden; plain layers; lm_head over the full vocabulary.
    Under tensor parallelism the draft's layers and lm_head are sharded like the target's; `fc` is priced
    replicated (the conservative assumption: it is small next to lm_head either way).
    """
    hidden = cfg.get("hidden_size", target_hidden)
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    hd = cfg.get("head_dim") or hidden // heads
    inter = cfg["intermediate_size"]
    layers = int(draft.num_layers or cfg.get("num_hidden_layers", 1))
    algo = get_algorithm(draft.algorithm)
    if not algo.takes_hidden_states:
        raise ValueError(f"a {algo.title} draft has no model to price")
    if algo.drafts_block:          # DFlash: target features projected by fc, plain layers, the full vocabulary
        n_feat = len(draft.capture_layers or [0])
        vocab = int(cfg.get("vocab_size") or draft.vocab_size)
        return ModelShape("draft", layers, hidden, heads, kv_heads, hd,
                          llama_layer_gemms(hidden, heads, kv_heads, hd, inter),
                          head_gemms=(Gemm("lm_head", hidden, vocab),),
                          input_gemms=(Gemm("fc", n_feat * target_hidden, hidden, split=False),))
    # EAGLE-3: layer 0's q/k/v read [embedding, hidden]; lm_head over the draft vocabulary
    n_aux = len(draft.capture_layers or [0, 0, 0])
    vocab = int(draft.draft_vocab_size or cfg.get("draft_vocab_size") or cfg["vocab_size"])
    return ModelShape("draft", layers, hidden, heads, kv_heads, hd,
                      llama_layer_gemms(hidden, heads, kv_heads, hd, inter, qkv_in=2 * hidden),
                      head_gemms=(Gemm("lm_head", hidden, vocab),),
                      input_gemms=(Gemm("fc", n_aux * target_hidden, hidden, split=False),))


# ------------------------------------------------------------------------------------------ machine


@dataclass(frozen=True)
class Precision:
    gemm_dtype: str          # which peak the GEMMs run at: "fp8", "bf16" (GPU) or a measured profile's dtype
    weight_bytes: float      # per weight element
    kv_bytes: float          # per KV element
    act_bytes: float = 2.0   # activations between ops (bf16)
    attn_dtype: str = "bf16"


@dataclass(frozen=True)
class Machine:
    """Achieved (not datasheet) rates of one device, plus how tensor-parallel ranks talk."""

    name: str
    peak_flops: dict          # dtype -> achieved FLOP/s
    bandwidth: float          # achieved memory bytes/s of weight-streaming GEMMs
    op_overhead_s: float = 0.0   # fixed cost per operation (launch, framework, sync)
    link_bandwidth: float = 0.0  # bytes/s per GPU for all-reduce (NVLink/PCIe); 0 = none
    link_latency_s: float = 8e-6
    memory_bytes: float = 0.0
    # Achieved rates of the other kernels where they differ from GEMMs (0 = same as `bandwidth`): a decode
    # attention kernel or an eager elementwise op rarely streams as well as a GEMV (on a CPU, far worse).
    attn_bandwidth: float = 0.0
    elem_bandwidth: float = 0.0
    attn_peak: float = 0.0       # achieved attention FLOP/s (0 = the GEMM peak of the attention dtype)
    # How memory and compute time combine in one kernel: (mem^p + compute^p)^(1/p). p = inf is the roofline's
    # max(); a measured GEMM at the ridge point that takes 2^(1/p) x the roofline gives p (a GPU GEMM overlaps
    # them: p large; a CPU adds them, p ~ 1, or does worse at a few rows, p < 1).
    overlap: float = math.inf
    # The same for attention kernels (a CPU's attention adds its KV streaming and its arithmetic: p = 1).
    attn_overlap: float = math.inf
    # A step whose whole working set fits in the last-level cache (a tiny model on a CPU) is partly served
    # from it: the fraction 1 - working_set / cache_bytes of its weight reads runs at cache_bandwidth.
    cache_bytes: float = 0.0
    cache_bandwidth: float = 0.0
    # Measured GEMM efficiency by row count: ((rows, factor), ...) sorted by rows, factor = measured time of a
    # GEMM at that many rows / this model's time for it (`runtime.cost.calibrate.calibrate`). Kernels change with M
    # (a CPU runs one row as a GEMV and two or more as a packed GEMM at twice the cost; a GPU picks tiles by
    # M); between the measured row counts the factor is interpolated in log(rows). Empty: factor 1.
    gemm_row_factors: tuple = ()
    # Measured weight-streaming rate by working set: ((bytes, bytes/s), ...) sorted by bytes, from a GEMV cycling
    # through that many bytes of weights (`runtime.cost.calibrate.calibrate`). Replaces the cache_bytes blend above
    # when present: how much of a working set a real cache keeps is measured, not assumed. Interpolated in
    # log-log; below the smallest point its rate, above the largest the streaming `bandwidth`.
    footprint_bandwidth: tuple = ()

    def weight_bandwidth(self, working_set: float) -> float | None:
        f = self.footprint_bandwidth
        if not f:
            return None
        if working_set <= f[0][0]:
            return f[0][1]
        if working_set >= f[-1][0]:
            return self.bandwidth
        for (w0, b0), (w1, b1) in itertools.pairwise(f):
            if w0 <= working_set <= w1:
                x = math.log(working_set / w0) / math.log(w1 / w0)
                return math.exp(math.log(b0) + x * (math.log(b1) - math.log(b0)))
        return self.bandwidth

    def gemm_factor(self, rows: float) -> float:
        f = self.gemm_row_factors
        if not f or rows <= 0:
            return 1.0
        if rows <= f[0][0]:
            return f[0][1]
        if rows >= f[-1][0]:
            return f[-1][1]
        for (r0, f0), (r1, f1) in itertools.pairwise(f):
            if r0 <= rows <= r1:
                w = math.log(rows / r0) / math.log(r1 / r0)
                return f0 + w * (f1 - f0)
        return 1.0

    def combine(self, mem: float, compute: float, p: float | None = None) -> float:
        p = self.overlap if p is None else p
        if math.isinf(p) or mem == 0 or compute == 0:
            return max(mem, compute)
        hi = max(mem, compute)
        return hi * ((mem / hi) ** p + (compute / hi) ** p) ** (1 / p)

    def bandwidth_for(self, kind: str) -> float:
        if kind == "attention" and self.attn_bandwidth:
            return self.attn_bandwidth
        if kind == "elementwise" and self.elem_bandwidth:
            return self.elem_bandwidth
        return self.bandwidth

    def peak(self, dtype: str) -> float:
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        # A measured profile knows only the dtype it measured: use it for every GEMM (said in the tune log).
        return next(iter(self.peak_flops.values()))

    def ridge_rows(self, prec: Precision) -> float:
        """GEMM rows M* where a weight-streaming GEMM turns compute-bound: 2 M / b = peak / bandwidth."""
        return self.peak(prec.gemm_dtype) / self.bandwidth * prec.weight_bytes / 2


def machine_from_gpu(gpu, *, compute_efficiency: float, memory_efficiency: float, op_overhead_us: float) -> Machine:
    """A `pipeline.hardware.GPU` datasheet entry scaled by efficiency factors."""
    peaks = {"bf16": gpu.bf16_tflops * 1e12 * compute_efficiency}
    if gpu.fp8_tflops:
        peaks["fp8"] = gpu.fp8_tflops * 1e12 * compute_efficiency
    return Machine(gpu.name, peaks, gpu.hbm_tb_s * 1e12 * memory_efficiency, op_overhead_us * 1e-6,
                   link_bandwidth=gpu.link_gb_s * 1e9, memory_bytes=gpu.memory_gb * 1e9)


def machine_from_profile(profile: dict, memory_gb: float = 0.0) -> Machine:
    """A measured profile (`specpipe profile`, bench/gpu_gemm_check.py): rates are already achieved ones."""
    m = profile["machine"]
    return Machine(profile.get("device", "measured"), {k: v * 1e12 for k, v in m["peak_tflops"].items()},
                   m["bandwidth_tb_s"] * 1e12, m["op_overhead_us"] * 1e-6,
                   link_bandwidth=(m.get("link_gb_s") or 0) * 1e9, memory_bytes=memory_gb * 1e9,
                   attn_bandwidth=(m.get("attn_bandwidth_tb_s") or 0) * 1e12,
                   elem_bandwidth=(m.get("elem_bandwidth_tb_s") or 0) * 1e12,
                   attn_peak=(m.get("attn_tflops") or 0) * 1e12,
                   overlap=float(m.get("overlap") or math.inf),
                   # profiles written before attn_overlap solved attention with the GEMM overlap
                   attn_overlap=float(m.get("attn_overlap") or m.get("overlap") or math.inf),
                   cache_bytes=float(m.get("cache_bytes") or 0), cache_bandwidth=(m.get("cache_bandwidth_tb_s") or 0) * 1e12,
                   gemm_row_factors=tuple((float(r), float(f)) for r, f in (m.get("gemm_row_factors") or ())),
                   footprint_bandwidth=tuple((float(w), float(b) * 1e12) for w, b in (m.get("footprint_bandwidth_tb_s") or ())))


# ------------------------------------------------------------------------------------------ step cost


@dataclass(frozen=True)
class Op:
    name: str
    flops: float
    bytes: float
    dtype: str
    count: int = 1   # identical instances (layers)

    kind: str = "gemm"   # gemm | attention | elementwise | allreduce
    rows: int = 0        # GEMM rows M (for the machine's measured efficiency by row count)

    def time(self, m: Machine, hot: float = 0.0, gemm_bandwidth: float | None = None) -> float:
        """Seconds for `count` instances; `hot` = fraction of GEMM bytes served from the last-level cache, or
        `gemm_bandwidth` = the measured rate of GEMM weight reads at this step's working set."""
        if self.kind == "allreduce":
            return self.count * (self.bytes / (m.link_bandwidth or m.bandwidth) + m.link_latency_s)
        peak = m.attn_peak if self.kind == "attention" and m.attn_peak else m.peak(self.dtype)
        compute = self.flops / peak if self.flops else 0.0
        mem = self.bytes / m.bandwidth_for(self.kind)
        if gemm_bandwidth and self.kind == "gemm":
            mem = self.bytes / gemm_bandwidth
        elif hot and self.kind == "gemm":
            mem = mem * (1 - hot) + self.bytes / m.cache_bandwidth * hot
        t = m.combine(mem, compute, m.attn_overlap if self.kind == "attention" else None)
        if self.kind == "gemm" and self.rows:
            t *= m.gemm_factor(self.rows)
        return self.count * (t + m.op_overhead_s)


def gemm_op(g: Gemm, rows: int, prec: Precision, tp: int, count: int = 1) -> Op:
    s = tp if g.split else 1
    flops = 2.0 * rows * g.k * g.n / s
    # Weights dominate at decode; activations in and out still count once M grows.
    byts = g.k * g.n * prec.weight_bytes / s + rows * (g.k + g.n) * prec.act_bytes / (s if g.split else 1)
    return Op(g.name, flops, byts, prec.gemm_dtype, count, rows=rows)


def forward_ops(shape: ModelShape, *, batch: int, q_len: int, context: int, prec: Precision, tp: int = 1,
                logits_rows: int | None = None, with_input_gemms: bool = True) -> list[Op]:
    """The operations of one forward pass: `batch` sequences with `q_len` new rows each over `context` cached
    tokens. `logits_rows` = rows that go through lm_head (default: all)."""
    rows = batch * q_len
    L = shape.num_layers
    ops = [gemm_op(g, rows, prec, tp, count=L) for g in shape.layer_gemms]
    flops, byts = attention_cost(shape, batch, q_len, context, prec, tp)
    ops.append(Op("attention", flops, byts, prec.attn_dtype, L, "attention"))
    ops.append(Op("elementwise", 0.0, elementwise_bytes(shape, rows, prec, tp), prec.attn_dtype, L, "elementwise"))
    if with_input_gemms:
        ops += [gemm_op(g, rows, prec, tp) for g in shape.input_gemms]
    lr = rows if logits_rows is None else logits_rows
    ops += [gemm_op(g, lr, prec, tp) for g in shape.head_gemms]
    if tp > 1:
        ops.append(allreduce_op(rows * shape.hidden * prec.act_bytes, tp, count=2 * L))
    return ops


def attention_cost(shape: ModelShape, batch: int, q_len: int, context: int, prec: Precision, tp: int = 1):
    """(FLOPs, bytes) of one layer's attention: each sequence's KV (context + its new rows) is read once and
    shared by its q_len query rows; the q and output rows are read and written."""
    rows = batch * q_len
    heads, kv_heads = max(1, shape.heads // tp), max(1, shape.kv_heads // tp)
    kv_read = batch * (context + q_len) * 2 * kv_heads * shape.head_dim * prec.kv_bytes
    qo = 2 * rows * heads * shape.head_dim * prec.act_bytes
    return 4.0 * rows * (context + q_len) * heads * shape.head_dim, kv_read + qo


def elementwise_bytes(shape: ModelShape, rows: int, prec: Precision, tp: int = 1) -> float:
    """One layer's norms, residual adds and SiLU x up: 2 RMSNorms (2 hidden each), 2 residual adds
    (3 hidden each), SiLU-and-multiply (3 x intermediate / tp); hidden states are replicated under TP."""
    inter = max((g.n for g in shape.layer_gemms if g.name == "gate_up_proj"), default=2 * shape.hidden) // 2
    return rows * (10 * shape.hidden + 3 * inter / tp) * prec.act_bytes


def allreduce_op(nbytes: float, tp: int, count: int) -> Op:
    # Ring all-reduce moves 2 (tp-1)/tp of the buffer over each GPU's link (priced against the link).
    return Op("allreduce", 0.0, 2.0 * (tp - 1) / tp * nbytes, "link", count, "allreduce")


def step_time(ops: list[Op], m: Machine) -> float:
    working_set = sum(op.bytes * op.count for op in ops if op.kind != "allreduce")
    bw = m.weight_bandwidth(working_set)
    hot = 0.0
    if bw is None and m.cache_bytes and m.cache_bandwidth:
        hot = max(0.0, 1.0 - working_set / m.cache_bytes)
    return sum(op.time(m, hot, bw) for op in ops)


@dataclass(frozen=True)
class Deployment:
    """Everything the optimiser needs besides acceptance: shapes, precisions, machine, parallelism."""

    target: ModelShape
    draft: ModelShape | None
    algorithm: str               # "eagle3" | "dflash"
    target_prec: Precision
    draft_prec: Precision
    machine: Machine
    tp: int = 1
    context: int = 2048

    def target_time(self, batch: int, q_len: int = 1) -> float:
        return step_time(forward_ops(self.target, batch=batch, q_len=q_len, context=self.context,
                                     prec=self.target_prec, tp=self.tp), self.machine)

    def draft_time(self, batch: int, k: int) -> float:
        """Cost of drafting k tokens for `batch` sequences (0 when k == 0)."""
        if k == 0 or self.draft is None:
            return 0.0
        d, p, c = self.draft, self.draft_prec, self.context
        if get_algorithm(self.algorithm).drafts_block:
            # One parallel pass: 1+k rows per sequence (last token + k masks), logits for the k masks.
            return step_time(forward_ops(d, batch=batch, q_len=1 + k, context=c, prec=p, tp=self.tp,
                                         logits_rows=batch * k), self.machine)
        # EAGLE-3: the first pass reads the 1+k verified rows' target features (fc), logits for the last row;
        # then k-1 single-row passes on the draft's own hidden state.
        t = step_time(forward_ops(d, batch=batch, q_len=1 + k, context=c, prec=p, tp=self.tp,
                                  logits_rows=batch), self.machine)
        if k > 1:
            t += (k - 1) * step_time(forward_ops(d, batch=batch, q_len=1, context=c, prec=p, tp=self.tp,
                                                 with_input_gemms=False), self.machine)
        return t

    def spec_time(self, batch: int, k: int) -> float:
        return self.target_time(batch, 1 + k) + self.draft_time(batch, k)

    def tree_draft_time(self, batch: int, steps: int, topk: int) -> float:
        """EAGLE-3 drafting a tree `steps` deep with `topk` branches (SGLang's speculative_num_steps /
        speculative_eagle_topk, as its documentation names them): the first pass over the 1+steps verified rows
        (logits for the last row), then steps-1 passes of `topk` rows per sequence, each with logits for all of them.
        This pass structure is this model's, not read from SGLang's source; what a tree costs besides is fitted
        (runtime.cost.engine_fit: tree_pass)."""
        if self.draft is None or steps == 0:
            return 0.0
        d, p, c = self.draft, self.draft_prec, self.context
        t = step_time(forward_ops(d, batch=batch, q_len=1 + steps, context=c, prec=p, tp=self.tp,
                                  logits_rows=batch), self.machine)
        if steps > 1:
            t += (steps - 1) * step_time(forward_ops(d, batch=batch, q_len=topk, context=c, prec=p, tp=self.tp,
                                                     with_input_gemms=False), self.machine)
        return t

    def tree_time(self, batch: int, steps: int, topk: int, nodes: int) -> float:
        """One tree step: the target verifies `nodes` tree tokens per sequence (SGLang's
        speculative_num_draft_tokens, the root included) after the draft built the tree."""
        return self.target_time(batch, nodes) + self.tree_draft_time(batch, steps, topk)
