"""How a sample becomes tokens through a chat template: the renderer this run uses (`data.chat_template`, else the
target's own; `runtime.text.chat_template.ChatRenderer`), the assistant-only loss mask of every training sample
(every assistant turn's content and its end of turn, checked per conversation), and the rendered text of an
evaluation prompt. A template that cannot give a trustworthy mask is refused, naming the sample."""
from __future__ import annotations

import hashlib
from pathlib import Path

from runtime.data.sources import Malformed, Sample
from runtime.errors import RuntimeFailure


def load_renderer(tok, chat_template: Path | None):
    """The chat template this run renders with (data.chat_template, else the target's own), checked to render a
    [user, assistant] conversation, and what the artifact records about it. (None, info) when there is none."""
    from runtime.text.chat_template import ChatRenderer, ChatTemplateError

    if chat_template is not None:
        text: str | None = Path(chat_template).expanduser().read_text(encoding="utf-8")
        source, field_name = f"data.chat_template ({chat_template})", "data.chat_template"
    elif getattr(tok, "chat_template", None):
        text, source, field_name = None, "the target's tokenizer", "the target's chat template"
    else:
        return None, {"source": None}
    r = ChatRenderer(tok, text)
    try:
        r.render([{"role": "user", "content": "Hello."}], add_generation_prompt=True)
        r.render([{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi."}])
        end = r.end_of_turn()
    except Exception as e:  # jinja raises many types
        raise RuntimeFailure(f"{field_name} ({source}) does not render a [user, assistant] conversation "
                             f"({type(e).__name__}: {str(e)[:300]}); fix it, or set data.chat_template to a template that "
                             "renders") from None
    try:
        header = r.generation_prompt()
    except ChatTemplateError:
        header = None               # refused later, with the sample, if a mask or a prompt needs it
    info = {"source": source, "sha256": hashlib.sha256(r.template.encode()).hexdigest(), "mask_method": r.method,
            "end_of_turn": end.token if end else None, "end_of_turn_id": end.token_id if end else None,
            "generation_prompt": header}
    return r, info


def need_template(r, s: Sample) -> None:
    """Refuse sample `s`, which needs a chat template, when there is none (`r` is None)."""
    if r is None:
        raise RuntimeFailure(f"conversation samples (e.g. {s.origin}) need a chat template, and the target's tokenizer has "
                             "none; set data.chat_template to a Jinja template file")


def template_error(s: Sample, err, info: dict) -> RuntimeFailure:
    return RuntimeFailure(
        f"{s.origin}: the loss mask cannot be derived from the chat template of {info['source']}: {err}. Nothing was "
        "masked; to proceed, set data.chat_template to a Jinja template whose renderings of a conversation and its "
        "prefixes agree (it then also renders the eval prompts: deploy with the same template), or give conversations "
        "whose only assistant turn is the last message")


def has_assistant(s: Sample) -> bool:
    return s.fmt == "messages" and any(m["role"] == "assistant" for m in s.content)


def _encode_train(r, tok, s: Sample, eos_id: int) -> tuple[list[int], list[int]] | None:
    """(input_ids, loss_mask), untruncated; None for samples without a response (prompt-only)."""
    if s.fmt == "messages":
        need_template(r, s)
        return r.encode(s.content) if has_assistant(s) else None
    if s.fmt == "text":
        if s.chat:
            need_template(r, s)
            return r.encode([{"role": "assistant", "content": s.content}])
        ids = tok(s.content, add_special_tokens=False)["input_ids"] + [eos_id]
        return ids, [1] * len(ids)
    return None  # a prompt without a response: only usable after regeneration


def encode_samples(r, tok, samples: list[Sample], max_length: int, eos_id: int, bad: Malformed, info: dict) -> list:
    """Every sample's (ids, mask) truncated to max_length, or None. Checks every conversation's mask, not one: a
    template error stops the stage (naming the sample); a sample-level one is counted as malformed."""
    from runtime.text.chat_template import ChatTemplateError

    out, empty, full = [], [], []
    for s in samples:
        try:
            e = _encode_train(r, tok, s, eos_id)
        except ChatTemplateError as err:
            if err.kind == "template":
                raise template_error(s, err, info) from None
            bad.add(s.origin, f"loss mask: {err}")
            out.append(None)
            continue
        if e is None:
            out.append(None)
            continue
        ids, mask = e
        if s.fmt == "messages" or s.chat:
            if sum(mask) == 0:
                empty.append(s)
            elif sum(mask) == len(mask):
                full.append(s)
        out.append((ids[:max_length], mask[:max_length]))
    if empty:
        raise RuntimeFailure(f"the chat template ({info['source']}) marks no assistant token in {len(empty)} conversation(s) "
                             f"with assistant turns (first: {empty[0].origin}), so their loss mask would be empty: its "
                             "{% generation %} ... {% endgeneration %} blocks do not cover the assistant messages; fix them, or "
                             "remove the tags (the assistant spans are then derived from the template's own renderings)")
    if full:
        raise RuntimeFailure(f"the chat template ({info['source']}) marks every token of {len(full)} conversation(s) as "
                             f"the assistant's (first: {full[0].origin}), so the loss mask would be all ones (training on "
                             "prompts too); fix the template's {% generation %} tags")
    return out


def render_prompt(r, tok, s: Sample) -> str:
    """The text of `s` as an evaluation prompt: a conversation up to its last non-assistant turn with the assistant
    header, a chat prompt as a user turn, the first half of a text sample, or a raw prompt as it is."""
    if s.fmt == "messages":
        need_template(r, s)
        msgs = list(s.content)
        while msgs and msgs[-1]["role"] == "assistant":
            msgs.pop()
        if not msgs:
            raise RuntimeFailure(f"{s.origin}: a conversation with no user turn cannot be an evaluation prompt")
        return r.render(msgs, add_generation_prompt=True)
    if s.fmt == "text":
        text = s.content
        cut = text.rfind("\n", 0, max(1, len(text) // 2))
        text = text[: cut if cut > 0 else len(text) // 2]
        if s.chat:
            need_template(r, s)
            return r.render([{"role": "user", "content": text}], add_generation_prompt=True)
        return text
    if s.chat:
        need_template(r, s)
        return r.render([{"role": "user", "content": s.content}], add_generation_prompt=True)
    return s.content
