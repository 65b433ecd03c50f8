"""Triton Python-backend model: the FP8 target + draft served through specpipe's speculative runtime on CPU.

Copied by `specpipe build` (stage `export`) into `triton_cpu/tensorrt_llm/1/model.py`. It has the request /
response interface of TensorRT-LLM's LLM-API Triton model (triton_backend/all_models/llmapi, see
`runtime/schemas/triton-llmapi-model.json`), so a client written against one works against the other:

- inputs: `text_input` (one prompt), optional `streaming`, `sampling_param_max_tokens` (default 32, as the
  LLM API's SamplingParams), `sampling_param_temperature`, `sampling_param_seed`, `sampling_param_stop`,
  `sampling_param_return_perf_metrics`, `return_finish_reason`, `return_stop_reason`, ...;
- outputs: `text_output` (the generated text; cumulative in each streamed response, as the LLM API's
  `CompletionOutput.text`), `finish_reason` / `stop_reason` when asked, and with
  `sampling_param_return_perf_metrics: true` the speculative-decoding metrics `acceptance_rate`,
  `total_accepted_draft_tokens`, `total_draft_tokens` plus the request timestamps;
- decoupled (streaming) and non-decoupled transaction policies both work; with streaming each decoding step
  (1 + accepted draft tokens) is one response, the last one carries the final flag and the metrics.

What the CPU runtime cannot do is refused with a message rather than ignored: top-k/top-p filtering,
penalties, best_of > 1, cumulative log-probs, KV-cache block metrics.

`specpipe_model.json` next to this file names the checkpoints (relative to this directory) and the draft length.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

UNSUPPORTED = {  # input -> value that means "off" (anything else is refused)
    "sampling_param_top_k": (0, 1), "sampling_param_top_p": (1.0,), "sampling_param_frequency_penalty": (0.0,),
    "sampling_param_presence_penalty": (0.0,), "sampling_param_best_of": (1,), "return_cumulative_logprob": (False,),
}


def _scalar(request, name, default=None):
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return default
    a = t.as_numpy()
    if a.size != 1:
        raise pb_utils.TritonModelException(f"Expected a scalar tensor for tensor {name}")
    v = a.reshape(-1)[0]
    return v.decode("utf-8") if isinstance(v, bytes) else v.item() if hasattr(v, "item") else v


def _strings(request, name) -> list[str]:
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return []
    return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in t.as_numpy().reshape(-1)]


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])
        here = Path(args["model_repository"]) / args["model_version"]
        spec = json.loads((here / "specpipe_model.json").read_text())
        src = spec.get("specpipe_src")
        try:
            import runtime.serving  # noqa: F401 - specpipe installed in the stub's environment
        except ImportError:
            if src and Path(src).is_dir():
                sys.path.insert(0, src)
        from runtime.serving import ServingEngine

        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(self.model_config)
        self.engine = ServingEngine(here / spec["target"], here / spec["draft"] if spec.get("draft") else None,
                                    draft_len=int(spec["draft_len"]))
        pb_utils.Logger.log_info(f"[specpipe] loaded {spec['target']} + {spec.get('draft')} (draft_len {spec['draft_len']}), "
                                 f"decoupled={self.decoupled}")

    def execute(self, requests):
        responses = []
        for request in requests:
            sender = request.get_response_sender() if self.decoupled else None
            try:
                final = self._serve(request, sender)
            except Exception as e:  # the client gets the message; the model stays up
                err = pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor("text_output", np.asarray(["N/A"], dtype=np.object_))],
                    error=pb_utils.TritonError(f"Error generating request: {e}"))
                if sender is not None:
                    sender.send(err, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                else:
                    responses.append(err)
                continue
            if sender is None:
                responses.append(final)
        return None if self.decoupled else responses

    def _serve(self, request, sender):
        prompts = _strings(request, "text_input")
        if len(prompts) != 1:
            raise pb_utils.TritonModelException(f"text_input must hold exactly one prompt, got {len(prompts)}")
        for name, off in UNSUPPORTED.items():
            v = _scalar(request, name)
            if v is not None and v not in off:
                raise pb_utils.TritonModelException(f"{name}={v} is not supported by specpipe's CPU runtime")
        streaming = bool(_scalar(request, "streaming", False))
        if streaming and not self.decoupled:
            raise pb_utils.TritonModelException("Streaming is only supported in decoupled mode.")
        want = {"finish": bool(_scalar(request, "return_finish_reason", False)),
                "stop": bool(_scalar(request, "return_stop_reason", False)),
                "perf": bool(_scalar(request, "sampling_param_return_perf_metrics", False))}
        kwargs = dict(max_tokens=int(_scalar(request, "sampling_param_max_tokens", 32)),
                      temperature=float(_scalar(request, "sampling_param_temperature", 0.0) or 0.0),
                      seed=int(_scalar(request, "sampling_param_seed", 0) or 0),
                      stop=_strings(request, "sampling_param_stop"))
        pending = []  # one step behind, so that the last streamed response can carry the final flag

        def on_text(text):
            if pending:
                sender.send(self._response(pending.pop(), None, want))
            pending.append(text)

        out = self.engine.complete(prompts[0], on_text=on_text if streaming else None, **kwargs)
        resp = self._response(out.text, out, want)
        if sender is not None:
            sender.send(resp, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return resp

    @staticmethod
    def _response(text, out, want):
        t = [pb_utils.Tensor("text_output", np.asarray([text.encode("utf-8")], dtype=np.object_))]
        if out is not None:
            if want["finish"]:
                t.append(pb_utils.Tensor("finish_reason", np.asarray([out.finish_reason], dtype=np.object_)))
            if want["stop"]:
                t.append(pb_utils.Tensor("stop_reason", np.asarray([str(out.stop_reason)], dtype=np.object_)))
            if want["perf"]:
                t += [pb_utils.Tensor("acceptance_rate", np.asarray([out.acceptance_rate], dtype=np.float32)),
                      pb_utils.Tensor("total_accepted_draft_tokens", np.asarray([out.total_accepted_draft_tokens], dtype=np.int32)),
                      pb_utils.Tensor("total_draft_tokens", np.asarray([out.total_draft_tokens], dtype=np.int32)),
                      pb_utils.Tensor("arrival_time_ns", np.asarray([out.arrival_time_ns], dtype=np.int64)),
                      pb_utils.Tensor("first_token_time_ns", np.asarray([out.first_token_time_ns], dtype=np.int64)),
                      pb_utils.Tensor("last_token_time_ns", np.asarray([out.last_token_time_ns], dtype=np.int64))]
        return pb_utils.InferenceResponse(output_tensors=t)
