"""Text in, text out over specpipe's speculative runtime: the one adapter the CPU Triton model uses.

`runtime.engine.speculative` works on token ids in batches. Serving needs a prompt string, the tokenizer, request
validation with messages a client can act on, per-step streaming and the per-request statistics TensorRT-LLM
reports (`acceptance_rate`, `total_accepted_draft_tokens`, `total_draft_tokens`: what the LLM-API Triton model
returns with `sampling_param_return_perf_metrics`). This module
and `runtime.serving.jobs` are the only places that know the runtime's API, so the Triton model
(runtime/serving/triton_model/model.py) and the tests that compare the server with the in-process runtime go through
the same code: `ServingEngine.complete` runs one request through the same job logic (`runtime.serving.jobs`) the
server's continuous-batching scheduler (`runtime.serving.batching`) runs many requests through.

Semantics follow TensorRT-LLM's LLM API where they are defined: the prompt is tokenized without special
tokens; `text` is the generated text only (the LLM API's `CompletionOutput.text`, cumulative when
streaming); generation ends at an end-of-sequence id (the tokenizer's EOS and every id of the checkpoint's
`generation_config.json`), after `max_tokens` (finish_reason `stop` / `length`), or at a stop string
(finish_reason `stop`, `stop_reason` the string; the request leaves the batch there, so its statistics end
there too). A prompt plus `max_tokens` must fit the target's context (`max_position_embeddings`).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from runtime.serving.jobs import Completion, GenerationRequest, Job, run_alone


class RequestError(ValueError):
    """A request the server refuses (the client can fix it); the message names the input and the limit."""


class ServingEngine:
    """An FP8 target + draft loaded once. `request(...)` validates, `complete(request)` serves one request
    in-process; `runtime.serving.batching.Scheduler` serves many at once on the same engine."""

    def __init__(self, target_dir: str | Path, draft_dir: str | Path | None, *, draft_len: int, device: str = "cpu",
                 eos_token_ids: list[int] | None = None, compute: str = "fp32"):
        """`compute`: the runtime's compute mode (`runtime.engine.compute.resolve_compute`: `fp32` exact, `bf16` faster
        on CPUs with native bf16 GEMMs, `auto`; docs/serving.md "Compute modes" says what each guarantees)."""
        from transformers import AutoTokenizer

        from runtime.engine.speculative import SpeculativeEngine, load_pair
        from runtime.engine.target import load_target

        self.tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
        if draft_dir is not None and draft_len > 0:
            model, draft = load_pair(str(target_dir), str(draft_dir), device=device)
        else:
            model, draft = load_target(str(target_dir), device=device), None
        self.engine = SpeculativeEngine(model, draft, compute=compute)
        self.draft_model = draft       # the draft module the drafter runs (runtime/serving/faults.py perturbs it)
        self.draft_len = draft_len if draft is not None else 0
        # the pipeline's stop ids (target.json via validate: the end of turn, checked against the chat template) when
        # the repository carries them; else what the checkpoint's tokenizer and generation_config.json say
        self.eos_token_ids = list(eos_token_ids) if eos_token_ids else eos_ids(target_dir, self.tokenizer)
        self.eos_token_id = self.tokenizer.eos_token_id
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.context = int(cfg.max_position_embeddings)

    def encode(self, prompt: str) -> list[int]:
        """`text_input` as TensorRT-LLM's LLM API tokenizes it for the production model (DefaultInputProcessor:
        `add_special_tokens=sampling_params.add_special_tokens`, default True; runtime/serving/prompt_format.py), so a
        client's prompt gives the same tokens on both repositories."""
        return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def request(self, prompt: str | bytes, *, max_tokens: int = 32, temperature: float = 0.0, top_p: float = 1.0,
                seed: int = 0, stop: list[str] | None = None) -> GenerationRequest:
        """Validate and tokenize; raises RequestError naming the input (as the Triton interface calls it)."""
        if isinstance(prompt, bytes):
            try:
                prompt = prompt.decode("utf-8")
            except UnicodeDecodeError as e:
                raise RequestError(f"text_input is not valid UTF-8 (byte 0x{prompt[e.start]:02x} at offset {e.start}); "
                                   "send the prompt as UTF-8 text") from None
        if not isinstance(prompt, str):
            raise RequestError(f"text_input must be a string, got {type(prompt).__name__}")
        if not prompt:
            raise RequestError("text_input is empty: send a non-empty prompt")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
            raise RequestError(f"sampling_param_max_tokens must be an integer, got {max_tokens!r}")
        if max_tokens < 1:
            raise RequestError(f"sampling_param_max_tokens must be >= 1, got {max_tokens}")
        if max_tokens >= self.context:
            raise RequestError(f"sampling_param_max_tokens={max_tokens} is not below the model's context of "
                               f"{self.context} tokens")
        if not (temperature >= 0.0) or temperature != temperature or temperature == float("inf"):
            raise RequestError(f"sampling_param_temperature must be a finite number >= 0, got {temperature}")
        if not (0.0 < top_p <= 1.0):
            raise RequestError(f"sampling_param_top_p must be in (0, 1], got {top_p}")
        ids = self.encode(prompt)
        if not ids:
            raise RequestError("text_input has no tokens after tokenization: send a non-empty prompt")
        if len(ids) >= self.context:
            raise RequestError(f"the prompt has {len(ids)} tokens; the model's context is {self.context}: "
                               "shorten the prompt")
        if len(ids) + max_tokens > self.context:
            raise RequestError(f"the prompt's {len(ids)} tokens + sampling_param_max_tokens={max_tokens} exceed the "
                               f"model's context of {self.context} tokens: ask for at most "
                               f"{self.context - len(ids)} tokens")
        for s in stop or []:
            if not isinstance(s, str):
                raise RequestError(f"sampling_param_stop must hold strings, got {s!r}")
        return GenerationRequest(prompt=prompt, prompt_ids=ids, max_tokens=int(max_tokens), temperature=float(temperature),
                                 top_p=float(top_p), seed=int(seed), stop=[s for s in (stop or []) if s])

    def complete(self, prompt: str | GenerationRequest, *, max_tokens: int = 32, temperature: float = 0.0,
                 seed: int = 0, top_p: float = 1.0, stop: list[str] | None = None,
                 on_text: Callable[[str], None] | None = None) -> Completion:
        """Generate for one prompt in-process (the same job logic as the server). `on_text(cumulative text)` is
        called after every decoding step whose text changed, until a stop string is reached."""
        req = prompt if isinstance(prompt, GenerationRequest) else self.request(
            prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, stop=stop)
        job = Job(self, req, on_text=on_text)
        run_alone(self, job)
        if job.error is not None:
            raise job.error
        return job.result


def eos_ids(model_dir: str | Path, tokenizer=None) -> list[int]:
    """Every id that ends a generation: the tokenizer's EOS and the checkpoint's generation_config.json
    `eos_token_id` (one id or a list: an instruct model's end-of-turn and its eos)."""
    ids: list[int] = []
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    gc = Path(model_dir) / "generation_config.json"
    if gc.exists():
        v = json.loads(gc.read_text()).get("eos_token_id")
        for e in ([v] if isinstance(v, int) else v or []):
            if int(e) not in ids:
                ids.append(int(e))
    return ids
