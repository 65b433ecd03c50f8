"""Text in, text out over specpipe's speculative runtime: the one adapter the CPU Triton model uses.

`runtime.speculative` works on token ids in batches and returns when every request is done. Serving needs a
prompt string, the tokenizer, per-step streaming and the per-request statistics TensorRT-LLM reports
(`acceptance_rate`, `total_accepted_draft_tokens`, `total_draft_tokens`, reference §4). This module is the
only place that knows the runtime's API, so the Triton model (runtime/triton_model/model.py) and the tests
that compare the server with the in-process runtime go through the same code.

Semantics follow TensorRT-LLM's LLM API where they are defined: the prompt is tokenized without special
tokens; `text` is the generated text only (the LLM API's `CompletionOutput.text`, cumulative when
streaming); generation ends at the tokenizer's EOS or after `max_tokens` (finish_reason `stop` / `length`);
stop strings cut the text (finish_reason `stop`, `stop_reason` the string). The statistics are those of the
runtime for the whole generation (a stop string only truncates what is returned).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str                 # "stop" | "length"
    stop_reason: str | None
    total_draft_tokens: int
    total_accepted_draft_tokens: int
    steps: int
    arrival_time_ns: int
    first_token_time_ns: int
    last_token_time_ns: int
    draft_len: int
    chunks: list[str] = field(default_factory=list)   # cumulative text after each decoding step

    @property
    def acceptance_rate(self) -> float:
        return self.total_accepted_draft_tokens / self.total_draft_tokens if self.total_draft_tokens else 0.0


class ServingEngine:
    """An FP8 target + draft loaded once; `complete(prompt, ...)` serves one request at a time."""

    def __init__(self, target_dir: str | Path, draft_dir: str | Path | None, *, draft_len: int, device: str = "cpu"):
        import torch
        from transformers import AutoTokenizer

        from runtime.speculative import SpeculativeEngine, load_pair, load_target

        self.tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
        if draft_dir is not None and draft_len > 0:
            model, draft = load_pair(str(target_dir), str(draft_dir), device=device)
        else:
            model, draft = load_target(str(target_dir), device=device), None
        self.engine = SpeculativeEngine(model, draft)
        self.draft_len = draft_len if draft is not None else 0
        self.eos_token_id = self.tokenizer.eos_token_id
        self._torch = torch

    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def complete(self, prompt: str, *, max_tokens: int = 32, temperature: float = 0.0, seed: int = 0,
                 stop: list[str] | None = None, on_text: Callable[[str], None] | None = None) -> Completion:
        """Generate for one prompt. `on_text(cumulative text)` is called after every decoding step whose text
        changed, until a stop string is reached."""
        arrival = time.time_ns()
        ids = self.encode(prompt)
        if not ids:
            raise ValueError("empty prompt after tokenization")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        stop = [s for s in (stop or []) if s]
        tokens: list[int] = []
        chunks: list[str] = []
        times: list[int] = []
        stopped: list[str] = []

        def on_step(_req: int, new: list[int]) -> None:
            times.append(time.time_ns())
            if stopped:
                return
            tokens.extend(new)
            text = self.decode(tokens)
            hit = _first_stop(text, stop)
            if hit is not None:
                stopped.append(hit[1])
                text = text[:hit[0]]
            if not chunks or text != chunks[-1]:
                chunks.append(text)
                if on_text is not None:
                    on_text(text)

        gen = self.engine.generate([ids], max_new_tokens=max_tokens, draft_len=self.draft_len, temperature=temperature,
                                   eos_token_id=self.eos_token_id, seed=seed, on_tokens=on_step)
        out = gen.tokens[0]
        text = self.decode(out)
        if stopped:
            text = text[:_first_stop(text, stop)[0]]
            finish = "stop"
        else:
            finish = "stop" if (self.eos_token_id is not None and out and out[-1] == self.eos_token_id) else "length"
        rs = gen.requests[0]
        return Completion(text=text, token_ids=out, finish_reason=finish, stop_reason=stopped[0] if stopped else None,
                          total_draft_tokens=rs.drafted, total_accepted_draft_tokens=rs.accepted, steps=rs.steps,
                          arrival_time_ns=arrival, first_token_time_ns=times[0] if times else arrival,
                          last_token_time_ns=times[-1] if times else arrival, draft_len=self.draft_len, chunks=chunks)


def _first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    hits = [(text.find(s), s) for s in stops if s in text]
    return min(hits) if hits else None
