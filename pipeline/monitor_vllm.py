"""`specpipe monitor --engine vllm`: the drift monitor (pipeline/monitor.py, same baseline, CUSUM and Prometheus
file) on a vLLM server (`specpipe serve --engine vllm` or any `vllm serve` of the exported pair).

vLLM returns no per-request speculative statistics, so both modes read its Prometheus counters
(`vllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens`, v1/spec_decode/metrics.py,
parsed by runtime/vllm/engine.parse_spec_decode): a draft is one verification step with a draft, so a round's
steps = delta drafts and accepted = delta accepted tokens (AL = 1 + accepted / drafts, validate's definition).
- active: per domain, a scrape, the validated prompts sent one at a time to the OpenAI completions endpoint as
  token ids (`prompt` = the data stage's rendered `prompt_ids`, so no chat template is applied twice), validate's
  max_new_tokens and temperature, another scrape; the delta is the domain's observation. Other traffic on the
  server during a probe is counted too (probe an idle replica, or use passive mode for live traffic).
- passive: the counters' delta since the previous round (live traffic, tested against the overall baseline); a
  counter that went down (a restarted server) counts from zero.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request

from pipeline.monitor import Monitor, ProbeError, _url


def _get(url: str, timeout: float) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - the operator's endpoint
            return r.read()
    except urllib.error.HTTPError as e:
        raise ProbeError(f"{url}: HTTP {e.code}: {e.read().decode(errors='replace')[:300]}") from None
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        raise ProbeError(f"{url}: no answer ({e})") from None


def read_vllm_counters(metrics_url: str, timeout: float = 10.0):
    """vLLM's spec-decode counters (summed over engines) from its /metrics; ProbeError when it has none."""
    from runtime.vllm.engine import parse_spec_decode

    c = parse_spec_decode(_get(_url(metrics_url), timeout).decode(errors="replace"))
    if c is None:
        raise ProbeError(f"{metrics_url}: no vllm:spec_decode_* counters (a vLLM server started without "
                         "--speculative-config, or not a vLLM /metrics endpoint)")
    return c


def served_model(url: str, timeout: float = 10.0) -> str:
    """The first model the server lists (GET /v1/models)."""
    try:
        data = json.loads(_get(f"{_url(url)}/v1/models", timeout)).get("data") or []
        return str(data[0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise ProbeError(f"{url}/v1/models lists no model: is this an OpenAI-compatible (vLLM) server?") from None


def served_root(url: str, timeout: float = 10.0) -> str | None:
    """The directory the server loaded its model from (GET /v1/models `root`), or None when it names none."""
    try:
        data = json.loads(_get(f"{_url(url)}/v1/models", timeout)).get("data") or []
        root = data[0].get("root") if data else None
    except (ValueError, AttributeError):
        return None
    return str(root) if root else None


def complete(url: str, model: str, prompt_ids: list[int], *, max_tokens: int, temperature: float, timeout: float) -> dict:
    body = {"model": model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": temperature}
    req = urllib.request.Request(f"{_url(url)}/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - the operator's endpoint
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise ProbeError(f"{url}: HTTP {e.code} for model '{model}': {e.read().decode(errors='replace')[:300]}") from None
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        raise ProbeError(f"{url}: no answer ({e})") from None


class VllmMonitor(Monitor):
    """The Monitor with vLLM's counters as the observations (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.metrics_url = self.metrics_url or (f"{_url(self.url)}/metrics" if self.url else None)

    def _observe_active(self) -> dict:
        out = {}
        for d, prompts in self.run.prompt_ids.items():
            before = read_vllm_counters(self.metrics_url, self.timeout)
            produced = 0
            for ids in prompts:
                r = complete(self.url, self.run.model_name, ids, max_tokens=self.run.max_new_tokens,
                             temperature=self.run.temperature, timeout=self.timeout)
                produced += bool((r.get("usage") or {}).get("completion_tokens"))
            delta = read_vllm_counters(self.metrics_url, self.timeout) - before
            self._check_k(d, delta)
            out[d] = (None, None) if (delta.drafts == 0 and produced) else (float(delta.drafts), float(delta.accepted))
        return out

    def _observe_passive(self) -> dict:
        now = read_vllm_counters(self.metrics_url, self.timeout)
        prev = (self.counters or {}).get("vllm")
        self.counters = {"vllm": now.to_json()}
        if prev is None or now.drafts < prev["drafts"]:       # first reading or a restarted server: all of it
            delta = now
        else:
            from runtime.vllm.engine import SpecDecodeCounters

            delta = now - SpecDecodeCounters(prev["drafts"], prev["draft_tokens"], prev["accepted"],
                                             list(prev.get("per_position") or []))
        self._check_k("overall", delta)
        return {"overall": (float(delta.drafts), float(delta.accepted))}

    def read_series(self) -> dict[str, dict]:
        c = read_vllm_counters(self.metrics_url, self.timeout)
        return {"vllm": {"steps": float(c.drafts), "accepted": float(c.accepted)}}

    def _check_k(self, domain: str, delta) -> None:
        if delta.drafts and delta.draft_tokens != delta.drafts * self.design.draft_len:
            self.echo(f"round {self.round} [{domain}] note: the server drafted {delta.draft_tokens / delta.drafts:.2f} "
                      f"tokens per step, the baseline assumes {self.design.draft_len} (--draft-len)")
