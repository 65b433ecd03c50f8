"""Triton Python-backend model: the FP8 target + draft served through specpipe's speculative runtime on CPU.

Copied by `specpipe build` (stage `export`) into `triton_cpu/tensorrt_llm/1/model.py`. It has the request /
response interface of TensorRT-LLM's LLM-API Triton model (triton_backend/all_models/llmapi, see
`runtime/trtllm/schemas/triton-llmapi-model.json`), so a client written against one works against the other:

- inputs: `text_input` (one prompt), optional `streaming`, `sampling_param_max_tokens` (default 32, as the
  LLM API's SamplingParams), `sampling_param_temperature`, `sampling_param_top_p`, `sampling_param_seed`,
  `sampling_param_stop`, `sampling_param_return_perf_metrics`, `return_finish_reason`, `return_stop_reason`,
  `stop` (cancel the live request with this request id, as the LLM-API model does);
- outputs: `text_output` (the generated text; cumulative in each streamed response, as the LLM API's
  `CompletionOutput.text`), `finish_reason` / `stop_reason` when asked, and with
  `sampling_param_return_perf_metrics: true` the speculative-decoding metrics `acceptance_rate`,
  `total_accepted_draft_tokens`, `total_draft_tokens` plus the request timestamps, sent as the LLM-API model sends
  them: with text_output's dtype (BYTES, the numbers as text: "12", "0.75"), not the FP32/INT32 config.pbtxt
  declares (Triton 2.51 passes them as sent; `_response`);
- with streaming each decoding step (1 + accepted draft tokens) is one response, the last one carries the
  final flag and the metrics.

Serving under load: `execute` validates each request and hands it to
`runtime.serving.batching.Scheduler`, whose thread runs continuous batching: requests join the running batch at the
next step and every live row is verified in one target forward. Beyond `specpipe_max_batch` decoding rows
and `specpipe_max_queue` waiting requests (config `parameters`, defaults 8 and 32) a request gets an
UNAVAILABLE "overloaded" error at once. A client that cancels or disconnects (Triton marks the request
cancelled: gRPC stream cancellation, HTTP connection closed) is noticed through `is_cancelled()` within
`specpipe_cancel_check_ms` (default 50) and its row is freed; it gets a CANCELLED error, as TensorRT-LLM's
model sends. Bad requests get an INVALID_ARG error naming the input and the model keeps serving. A
non-decoupled configuration (needed by Triton's HTTP `infer` endpoint, which refuses decoupled models) batches
the same way: each request's single response goes through its response sender.
`specpipe_draft_len` (config parameter) overrides the draft length; 0 serves the target autoregressively.
`specpipe_compute` (config parameter) overrides the exported compute mode (`export.cpu_compute`: fp32 | bf16 |
auto, docs/serving.md "Compute modes").

Prometheus metrics on Triton's metrics port (Python-backend custom metrics, labels `model`, `version`,
`instance` (the model instance and its stub's pid: a reloaded model starts new series)):
`specpipe_draft_tokens_total`, `specpipe_accepted_draft_tokens_total`, `specpipe_verification_steps_total`
(AL = 1 + accepted / steps), `specpipe_target_forwards_total`, `specpipe_decode_rows_total` (rows per forward
= rows / forwards), `specpipe_output_tokens_total`, `specpipe_requests_joined_running_batch_total`,
`specpipe_requests_total{outcome=...}`, gauges `specpipe_batch_rows`, `specpipe_queue_depth`,
`specpipe_max_batch`, `specpipe_max_queue`, `specpipe_draft_len`.

What the CPU runtime cannot do is refused with a message rather than ignored: top-k filtering, penalties,
best_of > 1, cumulative log-probs, KV-cache block metrics.

A TEST FAULT (runtime/serving/faults.py, off unless `SPECPIPE_TEST_FAULT_DRAFT_DECAY` is set in the server's
environment) corrupts the draft's weights in memory after N requests, for the monitor's engine-state test.

`specpipe_model.json` next to this file names the checkpoints (relative to this directory) and the draft length.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

UNSUPPORTED = {  # input -> value that means "off" (anything else is refused)
    "sampling_param_top_k": (0, 1), "sampling_param_frequency_penalty": (0.0,),
    "sampling_param_presence_penalty": (0.0,), "sampling_param_best_of": (1,), "return_cumulative_logprob": (False,),
}
DEFAULTS = {"specpipe_max_batch": 8, "specpipe_max_queue": 32, "specpipe_cancel_check_ms": 50}
COUNTERS = {
    "draft_tokens": ("specpipe_draft_tokens_total", "Draft tokens proposed to the target for verification"),
    "accepted_draft_tokens": ("specpipe_accepted_draft_tokens_total", "Draft tokens the target accepted"),
    "verification_steps": ("specpipe_verification_steps_total",
                           "Per-request verification steps (acceptance length = 1 + accepted / steps)"),
    "target_forwards": ("specpipe_target_forwards_total", "Batched target forwards of the decode loop"),
    "decode_rows": ("specpipe_decode_rows_total", "Request rows verified, summed over decode forwards"),
    "output_tokens": ("specpipe_output_tokens_total", "Tokens generated"),
    "requests_joined_running_batch": ("specpipe_requests_joined_running_batch_total",
                                      "Requests that joined a batch while other requests were decoding"),
}
OUTCOMES = ("completed", "cancelled", "rejected_overloaded", "rejected_invalid", "failed")
GAUGES = {"batch_rows": "Requests decoding now", "queue_depth": "Requests waiting for a batch slot",
          "max_batch": "Most requests decoding at once", "max_queue": "Most requests waiting",
          "draft_len": "Draft tokens per verification step"}


class _BadRequest(Exception):
    pass


def _scalar(request, name, default=None):
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return default
    a = t.as_numpy()
    if a.size != 1:
        raise _BadRequest(f"{name} must hold exactly one value, got shape {list(a.shape)}")
    v = a.reshape(-1)[0]
    if isinstance(v, bytes):
        try:
            return v.decode("utf-8")
        except UnicodeDecodeError:
            raise _BadRequest(f"{name} is not valid UTF-8") from None
    return v.item() if hasattr(v, "item") else v


def _strings(request, name) -> list:
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return []
    return list(t.as_numpy().reshape(-1))


def _check_unsupported(request):
    """An input of UNSUPPORTED set to anything but its "off" value is refused."""
    for name, off in UNSUPPORTED.items():
        v = _scalar(request, name)
        if v is not None and v not in off:
            raise _BadRequest(f"{name}={v} is not supported by specpipe's CPU runtime")


def _wanted_outputs(request) -> dict:
    """Which optional outputs the request asks for: finish reason, stop reason, perf metrics."""
    return {"finish": bool(_scalar(request, "return_finish_reason", False)),
            "stop": bool(_scalar(request, "return_stop_reason", False)),
            "perf": bool(_scalar(request, "sampling_param_return_perf_metrics", False))}


def _stop_strings(request) -> list:
    """`sampling_param_stop` as str values (UTF-8)."""
    stop = []
    for s in _strings(request, "sampling_param_stop"):
        try:
            stop.append(s.decode("utf-8") if isinstance(s, bytes) else str(s))
        except UnicodeDecodeError:
            raise _BadRequest("sampling_param_stop is not valid UTF-8") from None
    return stop


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])
        here = Path(args["model_repository"]) / args["model_version"]
        spec = json.loads((here / "specpipe_model.json").read_text())
        # The specpipe that exported this repository first (its runtime matches this file), else the installed one.
        src = spec.get("specpipe_src")
        if src and (Path(src) / "runtime" / "serving" / "batching.py").is_file() and src not in sys.path:
            sys.path.insert(0, src)
        from runtime.serving.adapter import ServingEngine
        from runtime.serving.batching import Scheduler
        from runtime.serving.faults import DraftDecay

        self.inputs = sorted(i["name"] for i in self.model_config.get("input", []))
        params = {k: v.get("string_value") for k, v in (self.model_config.get("parameters") or {}).items()}
        conf = {k: int(params.get(k) or spec.get(k) or d) for k, d in DEFAULTS.items()}
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(self.model_config)
        # The perf-metric outputs go out as the LLM-API model sends them: numpy arrays of text_output's dtype (TYPE_STRING
        # -> object), whatever config.pbtxt declares for them (model.py@044a90d209e380c95e23e8ae42f3583fa05ada78
        # `_create_response`: `np.asarray([spec_dec_metrics.total_draft_tokens], dtype=self.output_dtype)`); the Python
        # backend serialises each value with str(), so clients get BYTES "12", "0.75" (JSON strings on /generate).
        self.output_dtype = pb_utils.triton_string_to_numpy(
            pb_utils.get_output_config_by_name(self.model_config, "text_output")["data_type"])
        draft_len = int(params["specpipe_draft_len"]) if params.get("specpipe_draft_len") else int(spec["draft_len"])
        compute = params.get("specpipe_compute") or spec.get("compute") or "fp32"
        self.engine = ServingEngine(here / spec["target"], here / spec["draft"] if spec.get("draft") and draft_len else None,
                                    draft_len=draft_len, eos_token_ids=spec.get("eos_token_ids"), compute=compute)
        # `instance` differs between the old and the new instance of a reloaded model: Triton 2.51's core counts
        # references per MetricFamily object, not per shared prometheus series, so with identical labels the old
        # instance's cleanup deletes the series the new instance writes to (core r24.10 src/metric_family.cc
        # MetricFamily::Remove; the server then crashes with SIGSEGV on the next increment or scrape).
        labels = {"model": args["model_name"], "version": str(args["model_version"]),
                  "instance": f"{args.get('model_instance_name', 'instance')}:{os.getpid()}"}
        # A MetricFamily must outlive its Metrics (python_backend r24.10 README, custom metrics): keep both.
        self._families = []

        def family(name, desc, kind):
            self._families.append(pb_utils.MetricFamily(name=name, description=desc, kind=kind))
            return self._families[-1]

        C, G = pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE
        self._counters = {k: family(n, d, C).Metric(labels=labels) for k, (n, d) in COUNTERS.items()}
        outcomes = family("specpipe_requests_total", "Requests by outcome", C)
        for o in OUTCOMES:
            self._counters[f"requests_{o}"] = outcomes.Metric(labels={**labels, "outcome": o})
        self._gauges = {k: family(f"specpipe_{k}", d, G).Metric(labels=labels) for k, d in GAUGES.items()}
        self._gauges["max_batch"].set(conf["specpipe_max_batch"])
        self._gauges["max_queue"].set(conf["specpipe_max_queue"])
        self._gauges["draft_len"].set(self.engine.draft_len)
        self.fault = DraftDecay.from_env()      # a test fault, off unless the environment names it
        if self.fault is not None:
            pb_utils.Logger.log_warn(f"[specpipe] {self.fault.describe()}")
        self.scheduler = Scheduler(self.engine, max_batch=conf["specpipe_max_batch"], max_queue=conf["specpipe_max_queue"],
                                   cancel_check_s=conf["specpipe_cancel_check_ms"] / 1000.0, metrics=self._metric,
                                   log=pb_utils.Logger.log_error)
        pb_utils.Logger.log_info(f"[specpipe] loaded {spec['target']} + {spec.get('draft')} (draft_len {self.engine.draft_len}), "
                                 f"decoupled={self.decoupled}, max_batch={conf['specpipe_max_batch']}, "
                                 f"max_queue={conf['specpipe_max_queue']}, context={self.engine.context}")

    def _metric(self, name: str, value) -> None:
        try:
            if name.startswith("set:"):
                self._gauges[name[4:]].set(float(value))
            elif value:
                self._counters[name].increment(float(value))
        except Exception as e:  # noqa: BLE001 - metrics never break serving
            pb_utils.Logger.log_warn(f"[specpipe] metric {name}: {e}")

    # ------------------------------------------------------------------------------------------ requests
    def execute(self, requests):
        """Validate each request and hand it to the scheduler; every response goes through the request's
        response sender (decoupled: one per step when streaming; non-decoupled: exactly one, final, which the
        python backend allows since 23.x), so `execute` returns at once in both modes and requests from
        different clients share the running batch."""
        for request in requests:
            sender = request.get_response_sender()
            job, error = None, None
            try:
                job = self._job(request, sender)
            except _BadRequest as e:
                error = pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG)
                self._metric("requests_rejected_invalid", 1)
            except _Stop as e:
                error = pb_utils.TritonError(str(e), pb_utils.TritonError.CANCELLED)
            if job is not None:
                try:
                    self.scheduler.submit(job)
                except self._overloaded as e:
                    error = pb_utils.TritonError(str(e), pb_utils.TritonError.UNAVAILABLE)
            if error is not None:
                self._send(sender, pb_utils.InferenceResponse(error=error), final=True)
        return None

    @property
    def _overloaded(self):
        from runtime.serving.batching import Overloaded

        return Overloaded

    def _job(self, request, sender):
        """The scheduler's Job for a valid generation request; a bad one raises _BadRequest (checked in this order:
        parameters, stop, text_input, unsupported inputs, streaming, stop strings, sampling values)."""
        from runtime.serving.jobs import Job

        self._check_parameters(request)
        if bool(_scalar(request, "stop", False)):
            self._stop_by_id(request)
        prompts = _strings(request, "text_input")
        if len(prompts) != 1:
            raise _BadRequest(f"text_input must hold exactly one prompt, got {len(prompts)}")
        _check_unsupported(request)
        streaming = bool(_scalar(request, "streaming", False))
        if streaming and not self.decoupled:
            raise _BadRequest("Streaming is only supported in decoupled mode.")
        want = _wanted_outputs(request)
        req = self._engine_request(request, prompts[0], _stop_strings(request))
        pending: list[str] = []   # one step behind, so that the last streamed response can carry the final flag

        def on_text(text):
            if pending:
                self._send(sender, self._response(pending.pop(), None, want))
            pending.append(text)

        def on_done(job):
            if job.error is not None or job.cancelled:
                self._send(sender, self._error(job), final=True)
            else:
                self._send(sender, self._final(job, want), final=True)
                if self.fault is not None:         # the scheduler's thread, between decoding steps
                    self.fault.request_finished(self.engine.draft_model)

        job = Job(self.engine, req, on_text=on_text if streaming else None, on_done=on_done,
                  is_cancelled=sender.is_cancelled,
                  request_id=request.request_id() or "")
        return job

    def _check_parameters(self, request):
        """Request parameters other than Triton's own (`triton_*`) are refused: options are inputs here."""
        try:
            extra = json.loads(request.parameters() or "{}")
        except ValueError:
            extra = {}
        unknown = sorted(k for k in extra if not str(k).startswith("triton_"))
        if unknown:
            raise _BadRequest(f"unknown parameter(s) {unknown}: this model takes its options as inputs "
                              f"({', '.join(self.inputs)})")

    def _stop_by_id(self, request):
        """A `stop` request: cancel the live requests with its id, then raise _Stop (answered with CANCELLED)."""
        rid = request.request_id()
        if not rid:
            raise _BadRequest("A request id must be provided for request cancellation")
        n = self.scheduler.stop_request(rid)
        raise _Stop(f"Request cancelled by client ({n} request(s) with id {rid!r} stopped)")

    def _engine_request(self, request, prompt, stop):
        """The engine's request from the sampling inputs; a value the engine refuses raises _BadRequest."""
        from runtime.serving.adapter import RequestError

        temperature = _scalar(request, "sampling_param_temperature", 0.0)
        top_p = _scalar(request, "sampling_param_top_p", 1.0)
        try:
            return self.engine.request(prompt, max_tokens=int(_scalar(request, "sampling_param_max_tokens", 32)),
                                       temperature=float(0.0 if temperature is None else temperature),
                                       top_p=float(1.0 if top_p is None else top_p),
                                       seed=int(_scalar(request, "sampling_param_seed", 0) or 0), stop=stop)
        except RequestError as e:
            raise _BadRequest(str(e)) from None

    def _final(self, job, want):
        return self._response(job.result.text, job.result, want)

    def _error(self, job):
        from runtime.serving.batching import Cancelled, Overloaded

        if job.cancelled or isinstance(job.error, Cancelled):
            return pb_utils.InferenceResponse(error=pb_utils.TritonError("Request cancelled by client",
                                                                         pb_utils.TritonError.CANCELLED))
        code = pb_utils.TritonError.UNAVAILABLE if isinstance(job.error, Overloaded) else pb_utils.TritonError.INTERNAL
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(f"Error generating request: {job.error}", code))

    @staticmethod
    def _send(sender, resp, final=False):
        try:
            sender.send(resp, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)
        except Exception as e:  # noqa: BLE001 - a client that went away cannot be answered
            pb_utils.Logger.log_warn(f"[specpipe] could not send a response: {e}")

    def _response(self, text, out, want):
        t = [pb_utils.Tensor("text_output", np.asarray([text.encode("utf-8")], dtype=np.object_))]
        if out is not None:
            if want["finish"]:
                t.append(pb_utils.Tensor("finish_reason", np.asarray([out.finish_reason], dtype=np.object_)))
            if want["stop"]:
                t.append(pb_utils.Tensor("stop_reason", np.asarray([str(out.stop_reason)], dtype=np.object_)))
            if want["perf"]:
                t += [pb_utils.Tensor(name, np.asarray([value], dtype=self.output_dtype)) for name, value in (
                    ("acceptance_rate", out.acceptance_rate),
                    ("total_accepted_draft_tokens", out.total_accepted_draft_tokens),
                    ("total_draft_tokens", out.total_draft_tokens),
                    ("arrival_time_ns", out.arrival_time_ns), ("first_scheduled_time_ns", out.first_scheduled_time_ns),
                    ("first_token_time_ns", out.first_token_time_ns), ("last_token_time_ns", out.last_token_time_ns))]
        return pb_utils.InferenceResponse(output_tensors=t)

    def finalize(self):
        self.scheduler.shutdown()
        self._counters.clear()       # Metrics before their families
        self._gauges.clear()
        self._families.clear()


class _Stop(Exception):
    """A `stop` request: it cancels the requests with its id and is answered with CANCELLED."""
