"""The roofline cost model (runtime.cost.costmodel), the draft-length optimiser (runtime.cost.draft_length), TensorRT-LLM's
sizes (runtime.cost.tuning), the GPU table, and `specpipe profile` (runtime.cost.profile, calibrate, measure).

No timed assertions: measured numbers are only checked for shape and sanity; the accuracy of the fitted model
is measured and reported in docs/benchmarks.md, not asserted here.
"""
from __future__ import annotations

import json
import math

import pytest

from pipeline.hardware import GPUS
from runtime.cost import costmodel as cm
from runtime.cost import draft_length as dl
from runtime.cost import tuning
from runtime.records import DraftInfo, TargetInfo

from conftest import run_cli, tiny_overrides

L8B = cm.llama("8b", num_layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256)
L70B = cm.llama("70b", num_layers=80, hidden=8192, heads=64, kv_heads=8, intermediate=28672, vocab=128256)
FP8 = cm.Precision("fp8", 1.0, 1.0)
BF16 = cm.Precision("bf16", 2.0, 2.0)


def datasheet(gpu: str, eff: float = 1.0, overhead_us: float = 0.0) -> cm.Machine:
    return cm.machine_from_gpu(GPUS[gpu], compute_efficiency=eff, memory_efficiency=eff, op_overhead_us=overhead_us)


def test_gpu_table_has_the_datasheet_values():
    for key in ("h100_sxm", "h100_pcie", "h200", "b200", "a100_80gb", "l40s"):
        g = GPUS[key]
        assert g.bf16_tflops > 0 and g.hbm_tb_s > 0 and g.memory_gb > 0 and g.source.startswith("NVIDIA")
        assert g.fp8_tflops in (0.0, pytest.approx(2 * g.bf16_tflops, rel=0.02))   # FP8 doubles BF16 where present
    assert (GPUS["h200"].fp8_tflops, GPUS["h200"].hbm_tb_s, GPUS["h200"].memory_gb) == (1979.0, 4.8, 141)
    assert GPUS["h100_sxm"].hbm_tb_s == 3.35 and GPUS["b200"].hbm_tb_s == 8.0
    assert not GPUS["a100_80gb"].has_fp8 and GPUS["l40s"].has_fp8


def test_ridge_points_match_the_anchors():
    # anchors.md: H100 SXM FP8 ~590 FLOP/B -> M* ~295 rows; H200 ~412 FLOP/B -> ~206 rows; BF16 gives the same M*.
    assert GPUS["h100_sxm"].ridge_flop_per_byte() == pytest.approx(590, rel=0.01)
    assert datasheet("h100_sxm").ridge_rows(FP8) == pytest.approx(295, rel=0.01)
    assert datasheet("h200").ridge_rows(FP8) == pytest.approx(206, rel=0.01)
    assert datasheet("h200").ridge_rows(BF16) == pytest.approx(datasheet("h200").ridge_rows(FP8), rel=0.01)


def test_gemm_flops_and_bytes():
    g = cm.Gemm("x", 4096, 14336)
    op = cm.gemm_op(g, 8, FP8, tp=1)
    assert op.flops == 2 * 8 * 4096 * 14336
    assert op.bytes == pytest.approx(4096 * 14336 * 1 + 8 * (4096 + 14336) * 2)
    half = cm.gemm_op(g, 8, FP8, tp=2)
    assert half.flops == op.flops / 2 and half.bytes < 0.51 * op.bytes
    assert cm.gemm_op(cm.Gemm("lm", 4096, 32000, split=False), 8, FP8, tp=2).flops == 2 * 8 * 4096 * 32000


def test_kv_bytes_per_token_match_the_anchors():
    assert L70B.kv_bytes_per_token(1) == 160 * 1024       # Llama-3-70B FP8
    assert L70B.kv_bytes_per_token(2) == 320 * 1024       # BF16
    assert L70B.weight_params() == pytest.approx(69.5e9, rel=0.01)


def test_memory_bound_rows_are_nearly_free_and_compute_bound_rows_are_not():
    m = datasheet("h200", 0.85, 2.0)
    dep = cm.Deployment(L8B, None, "eagle3", FP8, FP8, m, context=1024)
    t1 = dep.target_time(1, 1)
    assert dep.target_time(1, 8) / t1 < 1.05              # 8 rows << ridge: the weights dominate
    assert dep.target_time(64, 1) / t1 < 1.6
    big = dep.target_time(1024, 1)
    assert dep.target_time(2048, 1) / big > 1.8            # far past the ridge: time ~ rows
    # 70B FP8 at batch 1 on one H200: >= ~15 ms per step (anchors: 70 GB / 4.8 TB/s).
    dep70 = cm.Deployment(L70B, None, "eagle3", FP8, FP8, datasheet("h200", 0.85, 2.0), context=4096)
    assert 14.5 <= dep70.target_time(1, 1) * 1e3 <= 25
    assert datasheet("h200").bandwidth * 1.0 == 4.8e12


def test_attention_reads_each_sequences_kv_once():
    f1, b1 = cm.attention_cost(L8B, batch=4, q_len=1, context=1000, prec=FP8)
    f4, b4 = cm.attention_cost(L8B, batch=4, q_len=4, context=997, prec=FP8)
    assert b1 < b4 < 1.05 * b1                             # same KV, shared by the 4 rows (+ their q and output)
    assert f4 == pytest.approx(4 * f1, rel=0.01)
    _, b_bf16 = cm.attention_cost(L8B, batch=4, q_len=1, context=1000, prec=cm.Precision("fp8", 1, 2))
    assert b_bf16 > 1.9 * b1                               # KV dtype matters


def test_tensor_parallel_splits_the_step():
    m = datasheet("h100_sxm", 0.85, 2.0)
    one = cm.Deployment(L70B, None, "eagle3", FP8, FP8, m, tp=1, context=2048).target_time(8, 1)
    two = cm.Deployment(L70B, None, "eagle3", FP8, FP8, m, tp=2, context=2048).target_time(8, 1)
    assert 0.45 < two / one < 0.65                          # half the weights per GPU, plus all-reduces
    ops = cm.forward_ops(L70B, batch=8, q_len=1, context=2048, prec=FP8, tp=2)
    assert any(o.kind == "allreduce" and o.count == 160 for o in ops)


def test_target_shape_from_the_record_names_what_target_json_lacks():
    from runtime.errors import RuntimeFailure

    doc = {"architecture": "LlamaForCausalLM", "num_layers": 2, "hidden_size": 64, "vocab_size": 128,
           "num_attention_heads": 4, "intermediate_size": 96}
    s = cm.target_shape(TargetInfo.from_json(doc))          # no num_key_value_heads, no head_dim: MHA, hidden / heads
    assert (s.heads, s.kv_heads, s.head_dim, s.num_layers) == (4, 4, 16, 2)
    with pytest.raises(RuntimeFailure, match="target.json lacks num_attention_heads or intermediate_size"):
        cm.target_shape(TargetInfo.from_json({k: v for k, v in doc.items() if k != "intermediate_size"}))


def test_draft_costs_eagle3_serial_dflash_parallel():
    dcfg = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
            "num_hidden_layers": 1, "vocab_size": 128256}
    e3 = cm.draft_shape(DraftInfo.from_json({"algorithm": "eagle3", "num_layers": 1, "aux_layer_ids": [1, 15, 28],
                                            "draft_vocab_size": 32000}), dcfg, 4096)
    assert e3.layer_gemms[0].k == 2 * 4096 and e3.input_gemms[0].k == 3 * 4096 and e3.head_gemms[0].n == 32000
    df = cm.draft_shape(DraftInfo.from_json({"algorithm": "dflash", "num_layers": 1, "target_layer_ids": [1, 10, 20, 30]}),
                        dcfg, 4096)
    m = datasheet("h200", 0.85, 2.0)
    dep_e3 = cm.Deployment(L8B, e3, "eagle3", FP8, BF16, m, context=1024)
    dep_df = cm.Deployment(L8B, df, "dflash", FP8, BF16, m, context=1024)
    assert dep_e3.draft_time(1, 0) == 0.0
    assert dep_e3.draft_time(1, 6) > 4 * dep_e3.draft_time(1, 1)     # k serial passes
    assert dep_df.draft_time(1, 6) < 1.5 * dep_df.draft_time(1, 1)   # one parallel pass
    with pytest.raises(ValueError):
        cm.draft_shape(DraftInfo.from_json({"algorithm": "medusa"}), dcfg, 4096)


def test_expected_tokens_matches_the_closed_form():
    for a in (0.0, 0.3, 0.8, 0.95):
        for k in range(0, 7):
            closed = (1 - a ** (k + 1)) / (1 - a)
            assert dl.expected_tokens([a] * k, k) == pytest.approx(closed)
    assert dl.expected_tokens([0.9, 0.0, 0.9], 3) == pytest.approx(1.9)
    a = dl.flat_acceptance(2.5, 4)
    assert dl.expected_tokens([a] * 4, 4) == pytest.approx(2.5, abs=1e-9)
    assert dl.mix_expected_tokens({"x": [1.0] * 2, "y": [0.0] * 2}, {"x": 3, "y": 1}, 2) == pytest.approx(0.75 * 3 + 0.25)


def test_choose_k_prefers_shorter_within_tolerance_and_turns_off_below_min():
    m = datasheet("h200", 0.85, 2.0)
    dep = cm.Deployment(L8B, None, "eagle3", FP8, FP8, m, context=1024)   # no draft cost: longer k always >=
    c = dl.choose_k(dep, {"d": [0.9, 0.9, 0.9, 0.01]}, {"d": 1}, 1, 4, tie_tolerance=0.01)
    assert c.k == 3                                          # position 4 adds ~0.3 %: not useful
    assert dl.choose_k(dep, {"d": [0.9, 0.9, 0.9, 0.01]}, {"d": 1}, 1, 4, tie_tolerance=0.0).k == 4
    off = dl.choose_k(dep, {"d": [0.05] * 3}, {"d": 1}, 1, 3, min_speedup=1.2)
    assert off.k == 0 and off.speedup == 1.0


def test_schedule_round_trip_for_every_step_function():
    """Every non-increasing step function tune can produce is written so that the targeted version runs exactly
    it, or refused where the version cannot (runtime/trtllm/draft_schedule.py; compat.SOURCES)."""
    import itertools

    from runtime.trtllm import compat
    from runtime.trtllm import draft_schedule as D

    r12, r13 = compat.release("1.2.1"), compat.release("1.3.0rc27")
    for ks_runs in itertools.product([5, 3, 1], [3, 1, 0], [1, 0]):
        for widths in ((1, 1, 1), (3, 7, 20), (10, 1, 5)):
            ks = []
            for k, w in zip(ks_runs, widths, strict=True):
                ks += [k] * w
            ks = [min(ks[: i + 1]) for i in range(len(ks))]        # non-increasing, as k_by_batch makes it
            n = len(ks)
            sched = D.DraftSchedule.from_ks(ks)
            assert sched.ks(n) == ks
            assert D.DraftSchedule.from_json(sched.to_json(n)) == sched
            sc = D.encode(sched, r12, "two_model", n)              # 1.2 two-model: anything, zeros included
            assert D.decode(sc, r12, "two_model", n) == sched
            if 0 in ks:                                           # 1.3 one-engine: never 0 (PR #16888)
                with pytest.raises(D.UnsupportedSchedule):
                    D.encode(sched, r13, "one_model", n)
            else:
                sc = D.encode(sched, r13, "one_model", n)
                assert D.decode(sc, r13, "one_model", n) == sched
                assert not ("draft_len_schedule" in sc and "max_concurrency" in sc)
            if len(set(ks)) > 1:                                  # 1.2 one-model: one length only
                with pytest.raises(D.UnsupportedSchedule, match="every batch size"):
                    D.encode(sched, r12, "one_model", n)


def test_choose_k_floor_and_best_constant_k():
    m = datasheet("h200", 0.85, 2.0)
    dep = cm.Deployment(L8B, L8B, "eagle3", FP8, FP8, m, context=128)     # a draft as large as the target: never pays
    off = dl.choose_k(dep, {"d": [0.5] * 3}, {"d": 1}, 1, 3)
    assert off.k == 0
    floor = dl.choose_k(dep, {"d": [0.5] * 3}, {"d": 1}, 1, 3, min_k=1)
    assert floor.k == 1 and floor.speedup == floor.speedups[1] < 1            # the least bad k >= 1
    assert dl.best_constant_k(dep, {"d": [0.5] * 3}, {"d": 1}, [1, 8], 3) == (0, 1.0)
    cheap = cm.Deployment(L8B, None, "eagle3", FP8, FP8, m, context=1024)
    k, gm = dl.best_constant_k(cheap, {"d": [0.9, 0.9, 0.9, 0.01]}, {"d": 1}, [1, 2, 4], 4)
    assert k == 3 and gm > 1


def test_cuda_graph_sizes_and_token_budget():
    g = tuning.cuda_graph_batch_sizes(90, [34, 35, 61, 62])
    assert g[:3] == [1, 2, 4] and {34, 35, 61, 62, 90} <= set(g) and max(g) == 90 and g == sorted(set(g))
    assert max(tuning.cuda_graph_batch_sizes(1000, [])) == 1000 and 512 in tuning.cuda_graph_batch_sizes(1000, [])
    assert tuning.max_num_tokens(256, 5, 8192) >= 256 * 6 and tuning.max_num_tokens(256, 5, 8192) % 64 == 0
    assert tuning.max_num_tokens(4, 3, 100) == 128


def test_overlap_and_cache_terms():
    m = cm.Machine("x", {"fp8": 1e12}, 1e9, overlap=1.0)
    assert m.combine(2.0, 3.0) == pytest.approx(5.0)
    assert cm.Machine("x", {"fp8": 1e12}, 1e9).combine(2.0, 3.0) == 3.0
    assert cm.Machine("x", {"fp8": 1e12}, 1e9, overlap=2.0).combine(3.0, 4.0) == pytest.approx(5.0)
    hot = cm.Machine("x", {"fp8": 1e15}, 1e9, cache_bytes=1e12, cache_bandwidth=1e10)
    cold = cm.Machine("x", {"fp8": 1e15}, 1e9)
    ops = cm.forward_ops(L8B, batch=1, q_len=1, context=16, prec=FP8)
    assert cm.step_time(ops, hot) < 0.2 * cm.step_time(ops, cold)


# ---------------------------------------------------------------------------------------------- profile


@pytest.fixture(scope="module")
def tiny_profile():
    import torch

    from runtime.cost import profile as P

    shape = cm.llama("t", num_layers=2, hidden=32, heads=2, kv_heads=1, intermediate=64, vocab=128)
    draft = cm.draft_shape(DraftInfo.from_json({"algorithm": "eagle3", "num_layers": 1, "aux_layer_ids": [0, 1]}),
                           {"hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1,
                            "intermediate_size": 64, "vocab_size": 128}, 32)
    return P.profile({"target": shape, "draft": draft}, device=torch.device("cpu"), gemm_dtype="float32",
                     rows=(1, 8), context=16, q_lens=(1, 4), rounds=1)


def test_profile_document_is_usable_by_tune(tiny_profile):
    from runtime.cost import profile as P

    doc = tiny_profile
    assert P.check_profile(doc) == []
    assert set(doc["models"]) == {"target", "draft"}
    pts = doc["models"]["target"]["points"]
    assert [(p["rows"], p["q_len"]) for p in pts] == [(1, 1), (8, 1), (8, 4)]
    assert all(p["measured_ms"] > 0 and p["predicted_ms"] > 0 and math.isfinite(p["error"]) for p in pts)
    m = cm.machine_from_profile(json.loads(json.dumps(doc)))
    assert m.peak("fp8") == m.peak("float32") > 0 and m.bandwidth > 0 and m.op_overhead_s > 0
    assert doc["machine"]["overlap"] >= 0.5
    assert [r for r, _ in doc["machine"]["gemm_row_factors"]] == [1, 8]      # one factor per profiled row count
    assert m.gemm_row_factors and m.footprint_bandwidth and m.attn_overlap == 1.0
    feet = [w for w, _ in doc["machine"]["footprint_bandwidth_tb_s"]]
    assert feet == sorted(set(feet)) and feet[-1] >= 3 * doc["machine"]["cache_bytes"]
    bad = json.loads(json.dumps(doc))
    bad["machine"]["gemm_row_factors"] = [[8, 1.0], [1, -1.0]]
    assert "gemm_row_factors" in P.check_profile(bad)[0]
    assert P.check_profile({"format": "x"}) and P.check_profile({"format": P.FORMAT, "machine": {}})


def test_profile_cli_on_the_tiny_target(tmp_path):
    out = tmp_path / "prof.json"
    r = run_cli("profile", "configs/tiny_fp8_eagle3.yaml", "--workdir", str(tmp_path / "wd"), "--out", str(out),
                "--rows", "1,4", "--rounds", "1", "--context", "32", *tiny_overrides("target"))
    assert r.returncode == 0, r.stderr
    assert "measured ms" in r.stdout and "predicted ms" in r.stdout and f"hardware.profile: {out}" in r.stdout
    assert "GEMM time factor by rows: M=1 " in r.stdout and "weight streaming by working set: " in r.stdout
    doc = json.loads(out.read_text())
    assert doc["models"]["target"]["shape"]["hidden"] == 64       # the overridden tiny target's shapes
    r = run_cli("profile", "configs/tiny_fp8_eagle3.yaml", "--rows", "x", *tiny_overrides("target"))
    assert r.returncode == 2 and "--rows" in r.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="asks for FP8 GEMMs where no CUDA GPU exists")
def test_profile_fp8_without_a_gpu_is_a_usage_error(tmp_path):
    """runtime.cost.profile raises its own RuntimeUsageError; the CLI prints it without a traceback, exit code 2."""
    r = run_cli("profile", "configs/tiny_fp8_eagle3.yaml", "--workdir", str(tmp_path / "wd"), "--dtype", "fp8",
                *tiny_overrides("target"))
    assert r.returncode == 2 and "--dtype fp8 needs a CUDA GPU" in r.stderr and "Traceback" not in r.stderr
    # run.device through the runner's resolution (pipeline/device.py): a config error naming the field, exit code 2
    r = run_cli("profile", "configs/tiny_fp8_eagle3.yaml", "--workdir", str(tmp_path / "wd"), "-o", "run.device=cuda",
                *tiny_overrides("target"))
    assert r.returncode == 2 and "run.device: cuda, but torch sees no CUDA device" in r.stderr, r.stderr


def test_gpu_check_script_runs_in_smoke_mode(tmp_path):
    """bench/gpu_gemm_check.py is meant for an H200; its --smoke mode keeps the script itself tested here."""
    import subprocess
    import sys

    from conftest import REPO

    r = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_gemm_check.py"), "--smoke", "--rows", "1,8",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=300,
                       env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads((tmp_path / "gemm_check.json").read_text())
    assert [p["rows"] for p in doc["stacks"]["tiny"]["points"]] == [1, 8]
    assert "| M | measured ms | datasheet ms |" in r.stdout
    from runtime.cost import profile as P

    assert P.check_profile(json.loads((tmp_path / "h200_profile.json").read_text())) == []


def test_measured_gemm_row_factors_scale_gemms_by_row_count():
    plain = cm.Machine("x", {"fp8": 1e12}, 1e9)
    fac = cm.Machine("x", {"fp8": 1e12}, 1e9, gemm_row_factors=((1, 0.5), (4, 1.0), (16, 2.0)))
    assert fac.gemm_factor(1) == 0.5 and fac.gemm_factor(4) == 1.0 and fac.gemm_factor(16) == 2.0
    assert fac.gemm_factor(2) == pytest.approx(0.75)          # halfway in log(rows)
    assert fac.gemm_factor(0.5) == 0.5 and fac.gemm_factor(1000) == 2.0   # clamped at the measured ends
    g = cm.gemm_op(cm.Gemm("w", 4096, 4096), 2, FP8, 1)
    a = cm.Op("attention", 1e6, 1e6, "bf16", kind="attention")
    assert g.time(fac) == pytest.approx(0.75 * g.time(plain))
    assert a.time(fac) == a.time(plain)                        # only GEMMs carry the factor


def test_measured_footprint_bandwidth_replaces_the_cache_blend():
    curve = ((1e6, 40e9), (1e7, 40e9), (4e7, 10e9))
    m = cm.Machine("x", {"fp8": 1e15}, 10e9, footprint_bandwidth=curve, cache_bytes=1e12, cache_bandwidth=1e13)
    assert m.weight_bandwidth(5e5) == 40e9 and m.weight_bandwidth(1e9) == 10e9
    assert m.weight_bandwidth(2e7) == pytest.approx(20e9)      # log-log: 40 -> 10 GB/s over 10 -> 40 MB
    small = cm.llama("s", num_layers=1, hidden=256, heads=4, kv_heads=4, intermediate=512, vocab=1024)
    ops = cm.forward_ops(small, batch=1, q_len=1, context=16, prec=FP8)
    gemm_bytes = sum(o.bytes * o.count for o in ops if o.kind == "gemm")
    gemm_time = sum(o.time(m, 0.0, m.weight_bandwidth(1.0)) for o in ops if o.kind == "gemm")
    assert gemm_time == pytest.approx(gemm_bytes / 40e9, rel=1e-3)   # a few-MB model streams at the cached rate


def test_attention_solve_reproduces_both_measurements():
    from runtime.cost.calibrate import _solve_attention

    bw, pk = 20e9, 50e9
    pts = [(b / bw + f / pk, f, b) for f, b in ((1.7e7, 1.7e7), (1.36e8, 1.76e7))]
    got_bw, got_pk = _solve_attention(pts)
    assert got_bw == pytest.approx(bw) and got_pk == pytest.approx(pk)
    m = cm.Machine("x", {"fp8": 1e15}, 1e9, attn_bandwidth=got_bw, attn_peak=got_pk, attn_overlap=1.0)
    for t, f, b in pts:
        assert cm.Op("attention", f, b, "bf16", kind="attention").time(m) == pytest.approx(t)
    # noise that makes one term negative gives the other term the whole time, finite (plain JSON)
    bw2, pk2 = _solve_attention([(1.0, 1.0, 10.0), (1.0, 8.0, 10.0)])
    assert math.isfinite(bw2) and math.isfinite(pk2) and bw2 == pytest.approx(10.0)


def test_profile_measures_the_committed_target_and_draft(tmp_path):
    """With committed target and train_draft artifacts, `specpipe profile` takes their shapes (read through
    pipeline.artifacts and handed to runtime.cost.profile), not the tiny config's."""
    from pipeline.commands.profile import profile_shapes

    from support.synthetic import LLAMA_8B, eagle3

    arts = tmp_path / "artifacts"
    draft, dcfg = eagle3(LLAMA_8B, 32000)
    for rel, doc in {"target/target.json": LLAMA_8B, "target/manifest.json": {}, "train_draft/draft.json": draft,
                     "train_draft/draft/config.json": dcfg, "train_draft/manifest.json": {}}.items():
        (arts / rel).parent.mkdir(parents=True, exist_ok=True)
        (arts / rel).write_text(json.dumps(doc))
    shapes, src = profile_shapes(None, arts)
    assert shapes["target"] == cm.target_shape(TargetInfo.from_json(LLAMA_8B))
    assert shapes["target"].hidden == LLAMA_8B["hidden_size"] and shapes["target"].num_layers == LLAMA_8B["num_layers"]
    assert shapes["draft"] == cm.draft_shape(DraftInfo.from_json(draft), dcfg, LLAMA_8B["hidden_size"])
    assert shapes["draft"].head_gemms[0].n == 32000          # the draft's reduced vocabulary, not the target's 128k
    assert "target.json" in src and "draft.json" in src
