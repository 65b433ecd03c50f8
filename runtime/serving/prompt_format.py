"""The prompt format clients of the LLM-API Triton model must use so that the target sees the tokens `validate` measured.

What the targeted container does with a request (TensorRT-LLM 1.2.1 in tritonserver:26.07-trtllm-python-py3; NVIDIA/
TensorRT-LLM sources as stored in the search index):
- triton_backend/all_models/llmapi/tensorrt_llm/1/model.py (stored 044a90d209e380c95e23e8ae42f3583fa05ada78)
  `_convert_request`: `text_input[0]` is passed to `LLM.generate_async` as it is; no chat template is applied, and
  helpers.py (stored 0df60f9ad779c4dc4f55da07e08b969fc4684e56) `get_sampling_params_from_request` reads no template or
  `add_special_tokens` input. The LLM-API model has no templated path.
- tensorrt_llm/inputs/registry.py `DefaultInputProcessor`: a text prompt is tokenized with
  `tokenizer.encode(prompt, add_special_tokens=sampling_params.add_special_tokens)`, and tensorrt_llm/sampling_params.py
  (stored 000a01de66f0eab4ab05640711f0253f50f5209c) defaults `add_special_tokens` to True: a tokenizer that adds a BOS
  adds it to the templated text too.
- The image's other chat paths: Triton's OpenAI frontend (triton-inference-server/server r26.07, python/openai/
  openai_frontend/engine/utils/triton.py `_create_trtllm_generate_request`) renders the template but sends inputs the
  LLM-API model does not declare (`stream`, `max_tokens`, ... and a [1, 1] `text_input`), so it cannot drive this model;
  TensorRT-LLM's own `trtllm-serve` (build's `deployment/serve.sh`, same image) renders it server-side on
  `/v1/chat/completions` (ChatCompletionRequest.add_special_tokens defaults to False there).

So with the Triton repository the client renders: `text_input` = the conversation rendered with the chat template the
draft was validated with (`add_generation_prompt=True`), minus the template's leading BOS text when the tokenizer adds a
BOS itself; then the model's tokens are exactly validate's `prompt_ids` (tokens of the rendered text, no added
specials). `specpipe monitor` builds its probes with `text_input_for`, the same rule.
"""
from __future__ import annotations

import hashlib
import json
import shlex

EXAMPLE_MESSAGES = [{"role": "user", "content": "Write a Python function that adds two numbers."}]


def template_sha256(template: str | None) -> str | None:
    return hashlib.sha256(template.encode()).hexdigest() if template is not None else None


def tokenizer_adds_bos(tok) -> bool:
    """True when the tokenizer puts its BOS in front of plain text by itself (Llama-3; not ChatML/GPT-2 styles)."""
    bos = getattr(tok, "bos_token_id", None)
    if bos is None:
        return False
    ids = list(tok("a", add_special_tokens=True)["input_ids"])
    plain = list(tok("a", add_special_tokens=False)["input_ids"])
    return ids[:1] == [bos] and ids[1:] == plain


def text_input_for(rendered: str, fmt: dict | None) -> str:
    """What a client sends as `text_input` for a prompt rendered with the chat template: the same text, without a
    leading BOS the tokenizer would add again (TensorRT-LLM tokenizes text prompts with add_special_tokens=True)."""
    if not fmt or not fmt.get("tokenizer_adds_bos"):
        return rendered
    bos = fmt.get("bos_token") or ""
    return rendered[len(bos):] if bos and rendered.startswith(bos) else rendered


def domain_formats(tok, template: str | None, prompts: dict[str, list[str]]) -> dict[str, str]:
    """Per validated domain: "chat" when every eval prompt ends with the template's generation prompt (data rendered
    it as a conversation), "raw" when none does (text sent as it is), else "mixed"."""
    if template is None:
        return {d: "raw" for d in prompts}
    from runtime.text.chat_template import ChatRenderer

    header = ChatRenderer(tok, template).generation_prompt()
    out = {}
    for d, ps in prompts.items():
        n = sum(bool(header) and p.endswith(header) for p in ps)
        out[d] = "chat" if n == len(ps) else "raw" if n == 0 else "mixed"
    return out


def describe(tok, template: str | None, *, template_file: str | None) -> dict:
    """The prompt format of a deployment: the chat template (file in the repository, sha256), whether the tokenizer adds a
    BOS itself, and an example conversation with the `text_input` a client sends for it. No template (raw-text
    prompts): `tok` may be None."""
    fmt = {"chat_template": template_file if template is not None else None,
           "chat_template_sha256": template_sha256(template),
           "tokenizer_adds_bos": tokenizer_adds_bos(tok) if tok is not None else None,
           "bos_token": getattr(tok, "bos_token", None),
           "add_generation_prompt": True, "example_messages": EXAMPLE_MESSAGES, "example_text_input": None}
    if template is not None:
        rendered = tok.apply_chat_template(EXAMPLE_MESSAGES, chat_template=template, tokenize=False,
                                           add_generation_prompt=True)
        fmt["example_text_input"] = text_input_for(rendered, fmt)
    return fmt


def readme_section(fmt: dict, container_path: str, model_name: str) -> str:
    """The Triton repository README's section on prompt rendering (the upstream sources: this module's docstring)."""
    doms = fmt.get("domains") or {}
    chat = sorted(d for d, k in doms.items() if k != "raw")
    raw = sorted(d for d, k in doms.items() if k == "raw")
    if fmt["chat_template"] is None or not chat:
        return ("\n## Prompts\nvalidate measured the draft on raw-text prompts (" + (", ".join(raw) or "no domain")
                + "): send `text_input` as plain text, as a completion. The LLM-API model applies no chat template"
                + (" (for conversations, render `chat_template.jinja` as below would describe; validate did not measure "
                   "such prompts).\n" if fmt["chat_template"] else ".\n"))
    here = shlex.quote(container_path)
    body = json.dumps({"text_input": fmt["example_text_input"], "sampling_param_max_tokens": 64,
                       "sampling_param_return_perf_metrics": True})
    bos = (f"\nThis tokenizer adds `{fmt['bos_token']}` to any text itself (TensorRT-LLM tokenizes `text_input` with "
           f"`add_special_tokens=True`), so drop the template's own leading `{fmt['bos_token']}`:\n"
           f"`text = text.removeprefix({fmt['bos_token']!r})`.\n") if fmt["tokenizer_adds_bos"] else ""
    return f"""
## Prompts: render the chat template before sending
The LLM-API model generates from `text_input` exactly as sent: it applies no chat template (the container's
`model.py` passes `text_input` to `LLM.generate_async`; it has no template option). The draft was validated on
prompts rendered with `chat_template.jinja` (this directory, sha256 `{fmt['chat_template_sha256'][:16]}...`;
domains {', '.join(chat)}{'; raw text, sent as it is: ' + ', '.join(raw) if raw else ''}); text
that is not rendered with it meets a draft that never saw such input, and acceptance drops. Render each
conversation with it, with the generation prompt, and send the text:
```python
from pathlib import Path
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained("{container_path}/{model_name}/1/target_fp8")
text = tok.apply_chat_template(messages, chat_template=Path({(container_path + '/chat_template.jinja')!r}).read_text(),
                               tokenize=False, add_generation_prompt=True)
```
{bos}For `messages = {json.dumps(fmt['example_messages'])}`:
```bash
curl -s localhost:8000/v2/models/{model_name}/generate -d {shlex.quote(body)}
```
Server-side templating in the same image: TensorRT-LLM's `trtllm-serve` renders the model's template on
`/v1/chat/completions` (`../../build/deployment/serve.sh`). Triton's OpenAI frontend cannot drive this model: its
TensorRT-LLM requests carry inputs (`stream`, `max_tokens`) the LLM-API model does not declare.
`prompt_format.json` states this format; `specpipe monitor` probes the endpoint with prompts rendered this way.
(Mounted elsewhere than {here}: change the paths.)
"""
