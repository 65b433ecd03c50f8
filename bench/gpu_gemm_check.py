"""GPU check of the tune stage's cost model: FP8 GEMM stacks of an 8B-shaped and a 70B-layer-shaped Llama,
step time vs M on the GPU, against the datasheet model (runtime.cost.costmodel with pipeline.hardware's table).

Prepared for one H200 and a few minutes of GPU time (about 2-4 min; peak memory ~25 GB). From the repository
root, on a machine with CUDA torch:

    python bench/gpu_gemm_check.py --gpu h200 --out "${OUT:-bench_out}"

It writes `<out>/gemm_check.json` (every point: measured, datasheet prediction, prediction at the default
efficiencies, and the model calibrated from `runtime.cost.calibrate` microbenchmarks) and `<out>/h200_profile.json`
(a specpipe hardware profile: `hardware.profile: <out>/h200_profile.json` makes `tune` use measured rates),
and prints a Markdown table for docs/benchmarks.md. `--smoke` runs tiny shapes on the CPU to check the
script itself (no GPU needed).

What is timed: per layer the fused q/k/v, o_proj, gate/up and down_proj GEMMs (FP8 E4M3 weights and
activations through torch._scaled_mm, per-tensor scales, BF16 output), then lm_head, captured in one CUDA
graph and replayed (TensorRT-LLM decodes under CUDA graphs too); no attention, so the comparison isolates the
GEMM roofline the draft-length choice depends on. Goal (issue 6): within 15 % of the datasheet model.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.hardware import GPUS  # noqa: E402
from runtime.cost import costmodel as cm  # noqa: E402

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 2048)


def stacks(smoke: bool) -> dict[str, cm.ModelShape]:
    if smoke:
        return {"tiny": cm.llama("tiny", num_layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=256)}
    return {
        # Llama-3.1-8B: all 32 layers + lm_head (~8 GB of FP8 weights).
        "llama8b": cm.llama("llama8b", num_layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336,
                            vocab=128256),
        # Llama-3.3-70B: 10 of its 80 layers + lm_head (~9.6 GB): the per-layer shapes decide the ridge.
        "llama70b_10layers": cm.llama("llama70b_10layers", num_layers=10, hidden=8192, heads=64, kv_heads=8,
                                      intermediate=28672, vocab=128256),
    }


def gemm_ops(shape: cm.ModelShape, rows: int, prec: cm.Precision) -> list[cm.Op]:
    """The cost model's ops for exactly what is timed: the GEMMs, no attention or elementwise work."""
    return ([cm.gemm_op(g, rows, prec, 1, count=shape.num_layers) for g in shape.layer_gemms]
            + [cm.gemm_op(g, rows, prec, 1) for g in shape.head_gemms])


class GemmStack:
    def __init__(self, shape: cm.ModelShape, dtype: str, device):
        import torch

        from runtime.cost.measure import Matmul

        gen = torch.Generator().manual_seed(0)
        self.layers = [[Matmul(g.k, g.n, dtype, device, gen) for g in shape.layer_gemms] for _ in range(shape.num_layers)]
        self.head = [Matmul(g.k, g.n, dtype, device, gen) for g in shape.head_gemms]
        self.act = torch.bfloat16 if dtype in ("fp8", "bfloat16") else getattr(torch, dtype)
        self.device = device
        self.max_k = max(g.k for g in (*shape.layer_gemms, *shape.head_gemms))

    def run(self, xs):
        # Each GEMM reads its own preallocated input: the timing is the GEMMs', not a chain of casts.
        out = None
        for layer in self.layers:
            for mm in layer:
                out = mm(xs[mm.k])
        for mm in self.head:
            out = mm(xs[mm.k])
        return out


def time_stack(stack: GemmStack, rows: int, use_graph: bool, iters: int) -> float:
    import torch

    ks = {mm.k for layer in stack.layers for mm in layer} | {mm.k for mm in stack.head}
    fp8 = any(mm.fp8 for mm in stack.head)
    # FP8 inputs are cast once here, so that only the GEMMs are timed (TensorRT-LLM fuses the activation
    # quantization into the preceding kernel).
    xs = {k: torch.randn(rows, k, device=stack.device).to(torch.float8_e4m3fn if fp8 else stack.act) for k in ks}
    if stack.device.type != "cuda":
        stack.run(xs)
        t = []
        for _ in range(max(3, iters // 4)):
            t0 = time.perf_counter()
            stack.run(xs)
            t.append(time.perf_counter() - t0)
        return min(t)
    for _ in range(3):
        stack.run(xs)
    torch.cuda.synchronize()
    fn = lambda: stack.run(xs)  # noqa: E731
    if use_graph:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            stack.run(xs)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            stack.run(xs)
        fn = g.replay
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", default="h200", choices=sorted(GPUS))
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-graph", action="store_true", help="time eager launches instead of one CUDA graph")
    ap.add_argument("--no-profile", action="store_true", help="skip the runtime.cost.calibrate calibration")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (checks the script, not a GPU)")
    return ap.parse_args()


def device_and_dtype(smoke: bool):
    """(device, GEMM dtype): the CPU in float32 for --smoke, else the GPU in FP8 (BF16 before compute capability
    8.9); None without a CUDA device."""
    import torch

    if smoke:
        return torch.device("cpu"), "float32"
    if not torch.cuda.is_available():
        return None
    return torch.device("cuda"), "fp8" if torch.cuda.get_device_capability() >= (8, 9) else "bfloat16"


def calibrate(args: argparse.Namespace, shapes: dict[str, cm.ModelShape], dtype: str, device, rows: list[int],
              t0: float):
    """runtime.cost.calibrate's microbenchmarks on the first stack's shapes: (calibration, the machine it gives), or
    (None, None) with --no-profile or when a calibration kernel is refused."""
    from runtime.cost import calibrate as C
    from runtime.cost import profile as P

    if args.no_profile:
        return None, None
    first = next(iter(shapes.values()))
    try:
        cal = C.calibrate(first, dtype, device, C.BenchSizes(context=1024 if not args.smoke else 32,
                                                             peak_rows=4096 if not args.smoke else 256, curve_rows=rows))
    except RuntimeError as e:   # keep the datasheet comparison even if a calibration kernel is refused
        print(f"calibration failed, continuing without it: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
        return None, None
    calibrated = C.machine_from_calibration(cal, dtype, P.device_name(device))
    print(f"calibration ({time.time() - t0:.0f}s): "
          + json.dumps({k: v for k, v in cal.items() if k != "benchmarks"}), file=sys.stderr)
    return cal, calibrated


def point(name: str, shape: cm.ModelShape, m: int, t: float, prec: cm.Precision, machines: dict) -> dict:
    """One measured point against the cost model on each of `machines` (datasheet, default efficiencies,
    calibrated when there is one), printed."""
    ops = gemm_ops(shape, m, prec)
    p = {"rows": m, "measured_ms": t * 1e3, "datasheet_ms": cm.step_time(ops, machines["datasheet"]) * 1e3,
         "default_efficiency_ms": cm.step_time(ops, machines["default_efficiency"]) * 1e3}
    if machines["calibrated"] is not None:
        p["calibrated_ms"] = cm.step_time(ops, machines["calibrated"]) * 1e3
    for k in ("datasheet_ms", "default_efficiency_ms", "calibrated_ms"):
        if k in p:
            p[k.replace("_ms", "_error")] = p[k] / p["measured_ms"] - 1
    flops = sum(o.flops * o.count for o in ops)
    byts = sum(o.bytes * o.count for o in ops)
    p["achieved_tflops"], p["achieved_tb_s"] = flops / t / 1e12, byts / t / 1e12
    print(f"{name} M={m:5d}: {p['measured_ms']:9.3f} ms  datasheet {p['datasheet_ms']:9.3f} "
          f"({100 * p['datasheet_error']:+5.1f}%)  default-eff {p['default_efficiency_ms']:9.3f} "
          f"({100 * p['default_efficiency_error']:+5.1f}%)  {p['achieved_tflops']:7.1f} TFLOP/s "
          f"{p['achieved_tb_s']:5.2f} TB/s", file=sys.stderr)
    return p


def measure_stack(args: argparse.Namespace, name: str, shape: cm.ModelShape, dtype: str, device, rows: list[int],
                  prec: cm.Precision, machines: dict) -> dict:
    """The measurement loop of one stack: its GEMMs timed at every M (a shape the kernel refuses is skipped)."""
    import torch

    stack = GemmStack(shape, dtype, device)
    pts = []
    for m in rows:
        try:
            t = time_stack(stack, m, not args.no_graph, args.iters)
        except RuntimeError as e:   # e.g. an FP8 GEMM shape the kernel refuses
            print(f"{name} M={m}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
            continue
        pts.append(point(name, shape, m, t, prec, machines))
    del stack
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"layers": shape.num_layers, "weight_params": shape.weight_params(), "points": pts}


def hardware_profile(args: argparse.Namespace, cal: dict, device, dtype: str, prec: cm.Precision) -> dict:
    """A specpipe hardware profile (`hardware.profile`) from the calibration."""
    import torch

    from runtime.cost import profile as P

    gpu = GPUS[args.gpu]
    prof = {"format": P.FORMAT, "device": P.device_name(device), "gpu_table_entry": args.gpu,
            "memory_gb": gpu.memory_gb, "torch": torch.__version__, "gemm_dtype": dtype,
            "machine": {"peak_tflops": {prec.gemm_dtype: cal["peak_tflops"]},
                        "bandwidth_tb_s": cal["bandwidth_tb_s"], "attn_bandwidth_tb_s": cal["attn_bandwidth_tb_s"],
                        "attn_tflops": cal["attn_tflops"], "elem_bandwidth_tb_s": cal["elem_bandwidth_tb_s"],
                        "overlap": cal["overlap"], "attn_overlap": 1.0, "op_overhead_us": cal["op_overhead_us"],
                        "cache_bytes": cal["cache_bytes"], "cache_bandwidth_tb_s": cal["cache_bandwidth_tb_s"],
                        "gemm_row_factors": cal["gemm_row_factors"],
                        "footprint_bandwidth_tb_s": cal["footprint_bandwidth_tb_s"], "link_gb_s": None},
            "calibration": cal, "source": "bench/gpu_gemm_check.py"}
    if not args.smoke:
        prof["machine"]["link_gb_s"] = gpu.link_gb_s
    return prof


def main() -> int:
    args = parse_args()

    import torch

    from runtime.cost import profile as P
    from runtime.cost.measure import precision_for

    dev = device_and_dtype(args.smoke)
    if dev is None:
        print("no CUDA device: this check needs the GPU (use --smoke to test the script on a CPU)", file=sys.stderr)
        return 2
    device, dtype = dev
    rows = [int(r) for r in args.rows.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = GPUS[args.gpu]
    prec = precision_for(dtype) if args.smoke else cm.Precision("fp8" if dtype == "fp8" else "bf16",
                                                                  1.0 if dtype == "fp8" else 2.0, 1.0)
    sheet = cm.machine_from_gpu(gpu, compute_efficiency=1.0, memory_efficiency=1.0, op_overhead_us=0.0)
    default = cm.machine_from_gpu(gpu, compute_efficiency=0.8, memory_efficiency=0.85, op_overhead_us=2.0)
    t0 = time.time()
    shapes = stacks(args.smoke)
    cal, calibrated = calibrate(args, shapes, dtype, device, rows, t0)
    results = {"device": P.device_name(device), "gpu_table_entry": args.gpu, "dtype": dtype, "cuda_graph": not args.no_graph,
               "torch": torch.__version__, "datasheet": {"fp8_tflops": gpu.fp8_tflops, "bf16_tflops": gpu.bf16_tflops,
                                                         "hbm_tb_s": gpu.hbm_tb_s, "source": gpu.source},
               "ridge_rows_datasheet": sheet.ridge_rows(prec), "calibration": cal, "stacks": {}}
    machines = {"datasheet": sheet, "default_efficiency": default, "calibrated": calibrated}
    for name, shape in shapes.items():
        results["stacks"][name] = measure_stack(args, name, shape, dtype, device, rows, prec, machines)
    results["wall_s"] = time.time() - t0
    (out / "gemm_check.json").write_text(json.dumps(results, indent=2))
    if cal is not None:
        prof = hardware_profile(args, cal, device, dtype, prec)
        (out / f"{args.gpu}_profile.json").write_text(json.dumps(prof, indent=2, default=str))
    print(markdown(results))
    return 0


def markdown(res: dict) -> str:
    lines = [f"Device {res['device']} ({res['dtype']} GEMMs, CUDA graph {res['cuda_graph']}); datasheet "
             f"{res['datasheet']['fp8_tflops']} FP8 TFLOP/s, {res['datasheet']['hbm_tb_s']} TB/s; ridge "
             f"{res['ridge_rows_datasheet']:.0f} rows.", ""]
    for name, s in res["stacks"].items():
        lines += [f"**{name}** ({s['layers']} layers, {s['weight_params'] / 1e9:.2f} B params)", "",
                  "| M | measured ms | datasheet ms | err | default-eff ms | err | calibrated ms | err | TFLOP/s | TB/s |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for p in s["points"]:
            cal = (f"{p['calibrated_ms']:.3f} | {100 * p['calibrated_error']:+.1f}%" if "calibrated_ms" in p else "- | -")
            lines.append(
                f"| {p['rows']} | {p['measured_ms']:.3f} | {p['datasheet_ms']:.3f} | {100 * p['datasheet_error']:+.1f}% | "
                f"{p['default_efficiency_ms']:.3f} | {100 * p['default_efficiency_error']:+.1f}% | {cal} | "
                f"{p['achieved_tflops']:.1f} | {p['achieved_tb_s']:.2f} |"
            )
        errs = [abs(p["datasheet_error"]) for p in s["points"]]
        if errs:
            lines += ["", f"max |datasheet error| {100 * max(errs):.1f}%, mean {100 * sum(errs) / len(errs):.1f}%", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
