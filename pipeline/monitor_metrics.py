"""Readers of the serving engines' own speculative-decoding metrics for `specpipe monitor` (pipeline/monitor.py,
pipeline/monitor_engines.py; vLLM's reader is pipeline/monitor_vllm.py), and the errors they raise. Every reader turns
what the engine publishes into cumulative (verification steps, accepted draft tokens) per series, so the monitor tests
a round's delta against the overall baseline; a round in which no step with a draft ran (an idle server, or iterations
that drafted nothing) adds no observation.

Names and semantics, read from the engines' source (the tests name file and commit):
- TensorRT-LLM `trtllm-serve`, Prometheus text on `/prometheus/metrics` (tensorrt_llm/metrics/collector.py):
  `trtllm_spec_decode_num_draft_tokens_total` and `trtllm_spec_decode_num_accepted_tokens_total` (counters, labels
  `model_name`, `engine_type`; fed by the iteration stats' `specDecodingStats.numDraftTokens` / `numAcceptedTokens`
  of iterations that drafted, NVIDIA/TensorRT-LLM PR #12545), and the per-position counters
  `trtllm_spec_decode_drafted_tokens_total` / `trtllm_spec_decode_accepted_tokens_total` with a `token_position`
  label (0-based; fed per finished request, PR #12636). The gauge `trtllm_spec_decode_acceptance_length` is the last
  iteration's value and is not used for the test. Steps = drafted / K (the deployed draft length), as for the
  active probes; accepted = accepted draft tokens. The totals are used when the server has them, else the
  per-position counters summed over positions.
- TensorRT-LLM JSON `/metrics` (trtllm-serve): a list of iteration stats (cpp/include/tensorrt_llm/executor/types.h
  IterationStats), each with an optional `specDecodingStats` {numDraftTokens (proposed draft tokens of all requests),
  numAcceptedTokens (accepted draft tokens), numRequestsWithDraftTokens (requests with at least one draft token in
  the batch), acceptanceLength, iterLatencyMS, draftOverhead}. One iteration is one verification step of each
  request that drafted, so steps = sum numRequestsWithDraftTokens, accepted = sum numAcceptedTokens over the
  iterations with numDraftTokens > 0 (TensorRT-LLM's own accuracy tests compute the AL the same way). Iterations
  already counted (their `iter` id at or below the last one seen) are skipped; a smaller id means a restarted server.
- SGLang, Prometheus text on `/metrics` (python/sglang/srt/metrics/collector.py): `sglang:spec_verify_calls_total`
  (verification calls, summed per finished request) and `sglang:generation_tokens_total`; AL = delta generation
  tokens / delta verify calls, SGLang's own per-request definition (completion tokens / verify calls). The gauges
  `sglang:spec_accept_length` / `sglang:spec_accept_rate` are the scheduler's last logging interval and are only
  reported. A server without the verify counter (older SGLang) cannot be tested passively: the reader says so.
"""
from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

from pipeline.errors import SpecpipeError


class ProbeError(SpecpipeError):
    """The endpoint could not be probed (unreachable, an error response, no speculative statistics)."""


def _url(u: str) -> str:
    u = u.rstrip("/")
    return u if u.startswith(("http://", "https://")) else f"http://{u}"


PERF_OUTPUTS = ("total_draft_tokens", "total_accepted_draft_tokens")


def perf_counts(out: dict, url: str) -> tuple[int, int]:
    """(draft tokens proposed, draft tokens accepted) of one LLM-API response. TensorRT-LLM's LLM-API Triton model
    sends these outputs with text_output's dtype whatever its config.pbtxt declares (triton_backend/all_models/llmapi/
    tensorrt_llm/1/model.py@044a90d209e380c95e23e8ae42f3583fa05ada78 `_create_response`:
    `np.asarray([spec_dec_metrics.total_draft_tokens], dtype=self.output_dtype)`), so Triton's /generate gives JSON
    strings ("12"); numbers and one-element lists are read as well. Anything else raises ProbeError naming the output."""
    vals = []
    for name in PERF_OUTPUTS:
        v = out.get(name)
        if isinstance(v, list) and len(v) == 1:
            v = v[0]
        try:
            f = float(v.decode() if isinstance(v, bytes) else v)
        except (TypeError, ValueError, UnicodeDecodeError):
            f = float("nan")
        if not (f >= 0 and f.is_integer()):
            raise ProbeError(f"{url}: output {name} = {v!r} is not a count of tokens (the LLM-API model's "
                             "sampling_param_return_perf_metrics outputs)")
        vals.append(int(f))
    if vals[1] > vals[0]:
        raise ProbeError(f"{url}: total_accepted_draft_tokens {vals[1]} > total_draft_tokens {vals[0]}")
    return vals[0], vals[1]


_LINE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?\s*$')
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample of a Prometheus text exposition (comments and unparsable lines skipped)."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line.strip())
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        labels = {k: v.replace('\\"', '"').replace("\\\\", "\\") for k, v in _LABEL.findall(m.group(2) or "")}
        out.append((m.group(1), labels, value))
    return out


def _key(labels: dict[str, str], drop: tuple[str, ...] = ()) -> str:
    return ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k not in drop)


TRTLLM_TOTALS = ("trtllm_spec_decode_num_draft_tokens_total", "trtllm_spec_decode_num_accepted_tokens_total")
TRTLLM_PER_POSITION = ("trtllm_spec_decode_drafted_tokens_total", "trtllm_spec_decode_accepted_tokens_total")


def trtllm_prometheus(text: str, draft_len: int) -> dict[str, dict]:
    """Cumulative {"steps", "accepted", "drafted", "per_position": {pos: [drafted, accepted]}} per series (labels
    without token_position) from trtllm-serve's /prometheus/metrics; {} when it has no speculative counters."""
    totals: dict[str, dict] = {}
    per_pos: dict[str, dict] = {}
    for name, labels, v in parse_prometheus(text):
        if name in TRTLLM_TOTALS:
            t = totals.setdefault(_key(labels), {"drafted": 0.0, "accepted": 0.0})
            t["drafted" if name == TRTLLM_TOTALS[0] else "accepted"] += v
        elif name in TRTLLM_PER_POSITION and "token_position" in labels:
            p = per_pos.setdefault(_key(labels, ("token_position",)), {})
            pos = p.setdefault(int(labels["token_position"]), [0.0, 0.0])
            pos[0 if name == TRTLLM_PER_POSITION[0] else 1] += v
    out = {}
    for series in set(totals) | set(per_pos):
        pp = per_pos.get(series, {})
        t = totals.get(series) or {"drafted": sum(d for d, _ in pp.values()), "accepted": sum(a for _, a in pp.values())}
        out[series] = {"drafted": t["drafted"], "accepted": t["accepted"], "steps": t["drafted"] / draft_len,
                       "per_position": {str(k): v for k, v in sorted(pp.items())}}
    return out


def trtllm_iterations(doc, after_iter: int | None) -> tuple[float, float, int | None, int]:
    """(steps, accepted draft tokens, last iteration id, iterations skipped for drafting nothing) over the iteration
    stats of trtllm-serve's JSON /metrics newer than `after_iter` (all of them when a smaller id shows a restart)."""
    items = []
    for it in doc if isinstance(doc, list) else []:
        if isinstance(it, str):
            try:
                it = json.loads(it)
            except ValueError:
                continue
        if isinstance(it, dict):
            items.append(it)
    ids = [it["iter"] for it in items if isinstance(it.get("iter"), int)]
    if after_iter is not None and ids and max(ids) < after_iter:
        after_iter = None                       # a restarted server numbers its iterations from 0 again
    steps = accepted = 0.0
    skipped = 0
    for it in items:
        if after_iter is not None and isinstance(it.get("iter"), int) and it["iter"] <= after_iter:
            continue
        spec = it.get("specDecodingStats") or {}
        if not spec or (spec.get("numDraftTokens") or 0) <= 0:
            skipped += 1
            continue
        steps += float(spec.get("numRequestsWithDraftTokens") or 0)
        accepted += float(spec.get("numAcceptedTokens") or 0)
    last = max(ids + ([after_iter] if after_iter is not None else []), default=None)
    return steps, accepted, last, skipped


SGLANG_VERIFY, SGLANG_GENERATED = "sglang:spec_verify_calls_total", "sglang:generation_tokens_total"
SGLANG_GAUGES = ("sglang:spec_accept_length", "sglang:spec_accept_rate")


def sglang_prometheus(text: str) -> tuple[dict[str, dict], dict[str, float]]:
    """(cumulative {"steps", "accepted"} per series, the last acceptance gauges averaged over ranks) from SGLang's
    /metrics; the series dict is empty when the server has no verify-call counter."""
    verify: dict[str, float] = {}
    generated: dict[str, float] = {}
    gauges: dict[str, list[float]] = {}
    for name, labels, v in parse_prometheus(text):
        if name == SGLANG_VERIFY:
            verify[_key(labels)] = verify.get(_key(labels), 0.0) + v
        elif name == SGLANG_GENERATED and not labels.get("cache_source"):
            generated[_key(labels)] = generated.get(_key(labels), 0.0) + v
        elif name in SGLANG_GAUGES:
            gauges.setdefault(name, []).append(v)
    series = {k: {"steps": n, "accepted": max(generated.get(k, 0.0) - n, 0.0)} for k, n in verify.items()}
    return series, {k: sum(v) / len(v) for k, v in gauges.items()}


def read_counters(metrics_url: str, model: str) -> dict[str, dict[str, float]]:
    """The CPU model's speculation counters from Triton's Prometheus endpoint, per series (its labels: versions
    and instances; a reloaded model starts new series)."""
    try:
        with urllib.request.urlopen(_url(metrics_url), timeout=10) as r:  # noqa: S310
            text = r.read().decode()
    except (urllib.error.URLError, OSError) as e:
        raise ProbeError(f"{metrics_url}: no answer ({e})") from None
    names = {"specpipe_draft_tokens_total": "drafted", "specpipe_accepted_draft_tokens_total": "accepted",
             "specpipe_verification_steps_total": "steps"}
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        name, _, rest = line.partition("{")
        if name in names and f'model="{model}"' in rest:
            series = rest.rsplit("}", 1)[0]
            out.setdefault(series, {v: 0.0 for v in names.values()})[names[name]] = float(line.rsplit(" ", 1)[1])
    if not out:
        if f'model="{model}"' in text and "nv_inference_" in text:
            raise ProbeError(TRITON_LLMAPI_NO_COUNTERS.format(url=metrics_url, model=model))
        raise ProbeError(f"{metrics_url}: no specpipe_* counters for model '{model}' (passive mode needs the CPU "
                         "model's metrics; a TensorRT-LLM endpoint: use active probes)")
    return out


# A Triton server whose model has Triton's own nv_inference_* series but no speculative counters: TensorRT-LLM's
# LLM-API Triton model (triton_backend/all_models/llmapi/tensorrt_llm/1/model.py@044a90d209e380c95e23e8ae42f3583fa05ada78)
# creates no pb_utils.MetricFamily; its speculative statistics are per-request output tensors that go to the client
# that asked for them (sampling_param_return_perf_metrics), so no scrape can see the traffic's acceptance.
TRITON_LLMAPI_NO_COUNTERS = (
    "{url}: Triton serves model '{model}' without speculative counters (TensorRT-LLM's LLM-API Triton model publishes "
    "none to /metrics: its acceptance figures are per-request outputs for the client that asks, "
    "sampling_param_return_perf_metrics). The canary (--url) works on it; the traffic signal (--traffic, --passive) "
    "needs counters: serve the same export with trtllm-serve (--engine trtllm) or specpipe's CPU model, or run the "
    "canary alone (an alarm's diagnosis then says which signal is missing)")


def get_text(url: str, timeout: float) -> str:
    """GET a metrics page; ProbeError when the server does not answer."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - the operator's endpoint
            return r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        raise ProbeError(f"{url}: HTTP {e.code}: {e.read().decode(errors='replace')[:300]}") from None
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        raise ProbeError(f"{url}: no answer ({e})") from None
