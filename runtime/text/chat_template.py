"""Chat templates as training data needs them: assistant-only loss masks from any template, the end-of-turn
token, and the checks that make a derived mask trustworthy.

Two ways to find the assistant's tokens in a rendered conversation:

- `{% generation %} ... {% endgeneration %}` tags in the template (transformers' `return_assistant_tokens_mask`):
  used exactly as the template marks them.
- Any other template (the stock ones of Llama-3.x, Qwen3, SmolLM2 have no tags): for every assistant message i,
  render the conversation before it with the generation prompt (`messages[:i]`, `add_generation_prompt=True`:
  everything up to and including the assistant header) and with it (`messages[:i+1]`). The text between the two
  is the turn; the loss mask covers it from the first character after the header through the template's
  end-of-turn token (ChatML `<|im_end|>`, Llama-3 `<|eot_id|>`), and nothing after it (ChatML's newline after
  `<|im_end|>` separates turns; the model never generates it: it stops at `<|im_end|>`).

The derivation is only trusted when the renderings agree with each other and with the tokenizer:
  0. `add_generation_prompt=True` appends an assistant header (else header and content cannot be told apart);
  1. `render(messages[:i], gen)` is a prefix of `render(messages[:i+1])`: the generation prompt is how the
     template starts an assistant turn (a template that opens a turn differently fails here);
  2. `render(messages[:i+1])` is a prefix of `render(messages)`: later turns do not change this turn's text
     (Qwen3's template drops earlier turns' `<think>` reasoning and fails here, by design of that template);
  3. the assistant turn is closed by the end-of-turn token (a template that leaves the last message open fails);
  4. each span boundary is a token boundary: the tokens of the text before it are a prefix of the tokens of
     the whole conversation (so the prompt a server tokenizes is exactly the start of the training sample).
A failure raises `ChatTemplateError` saying which message, which check and what text differs; `kind` is
"template" when the template itself is at fault (every conversation of that shape fails) and "sample" when
only this sample's text is (a token that straddles the header and the content).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

GENERATION_TAG = re.compile(r"\{%-?\s*(?:end)?generation\s*-?%\}")
_PROBE = "Specpipe probe 7351."          # assistant content used to find the end-of-turn token
_PROBE_USER = "Hello."


class ChatTemplateError(ValueError):
    """The template's renderings cannot give a trustworthy loss mask (see the module docstring)."""

    def __init__(self, message: str, *, turn: int | None = None, kind: str = "template"):
        super().__init__(message)
        self.turn = turn
        self.kind = kind


def has_generation_tags(template: str) -> bool:
    return bool(re.search(r"\{%-?\s*generation\s*-?%\}", template))


def check_template_syntax(text: str) -> str | None:
    """None if `text` parses as a Jinja chat template (generation tags allowed), else the parser's message."""
    import jinja2

    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"], trim_blocks=True, lstrip_blocks=True)
    try:
        env.parse(GENERATION_TAG.sub("", text))
    except jinja2.TemplateSyntaxError as e:
        return f"line {e.lineno}: {e.message}"
    return None


def _snip(s: str, at: int, width: int = 48) -> str:
    return repr(s[max(0, at - 16): at + width])


def _first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@dataclass(frozen=True)
class TurnEnd:
    token_id: int
    token: str


class ChatRenderer:
    """Renders and tokenizes conversations with one chat template (the tokenizer's own, or `template`)."""

    def __init__(self, tok, template: str | None = None):
        self.tok = tok
        self.template = template if template is not None else tok.get_chat_template()
        self.tagged = has_generation_tags(self.template)
        self._end: TurnEnd | None | bool = False           # False: not detected yet
        self._header: str | None = None

    # -------------------------------------------------------------------------------------- rendering

    def render(self, messages: list[dict], *, add_generation_prompt: bool = False) -> str:
        return self.tok.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                            add_generation_prompt=add_generation_prompt)

    def encode_text(self, text: str) -> list[int]:
        """Tokens of rendered text, as `apply_chat_template(tokenize=True)` makes them (no added specials)."""
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The tokens a server feeds the target for the next assistant turn after `messages`."""
        self._require_header()
        return self.encode_text(self.render(messages, add_generation_prompt=True))

    def _require_header(self) -> None:
        if not self.generation_prompt():
            raise ChatTemplateError(
                "the template adds nothing for add_generation_prompt=True, so a prompt does not open the assistant's "
                "turn and the assistant header cannot be told from the assistant's text")

    def _added_ids(self) -> set[int]:
        ids = set(getattr(self.tok, "all_special_ids", []) or [])
        ids |= set(getattr(self.tok, "added_tokens_decoder", {}) or {})
        return ids

    def generation_prompt(self) -> str:
        """The text `add_generation_prompt=True` appends: the template's assistant header (`<|im_start|>assistant\\n`)."""
        if self._header is None:
            msgs = [{"role": "user", "content": _PROBE_USER}]
            plain, gen = self.render(msgs), self.render(msgs, add_generation_prompt=True)
            if not gen.startswith(plain):
                n = _first_difference(plain, gen)
                raise ChatTemplateError(
                    f"with add_generation_prompt=True the template changes the text before the assistant header "
                    f"(at char {n}: {_snip(plain, n)} becomes {_snip(gen, n)})")
            self._header = gen[len(plain):]
        return self._header

    def header_ids(self) -> set[int]:
        """Special/added tokens of the assistant header: they start a turn and never end one."""
        added = self._added_ids()
        return {t for t in self.encode_text(self.generation_prompt()) if t in added}

    def end_of_turn(self) -> TurnEnd | None:
        """The special (added) token the template puts right after an assistant message's content, or None when
        it puts none there. Found by rendering [user, assistant] (and, for templates that leave the last message
        open, [user, assistant, user])."""
        if self._end is not False:
            return self._end  # type: ignore[return-value]
        self._end = None
        added = self._added_ids()
        convs = ([{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE}],
                 [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE},
                  {"role": "user", "content": _PROBE_USER}])
        for msgs in convs:
            text = self.render(msgs)
            at = text.find(_PROBE)
            if at < 0:
                continue
            end = at + len(_PROBE)
            ids = self.encode_text(text)
            pre = self.encode_text(text[:end])
            if ids[:len(pre)] == pre and len(ids) > len(pre) and ids[len(pre)] in added:
                t = ids[len(pre)]
                self._end = TurnEnd(t, self.tok.convert_ids_to_tokens(t))
                break
        return self._end

    # -------------------------------------------------------------------------------------- masks

    @property
    def method(self) -> str:
        return "generation_tags" if self.tagged else "prefix_renderings"

    def encode(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        """(input_ids, loss_mask) of a whole conversation: 1 on every assistant turn's tokens and its end-of-turn
        token, 0 elsewhere. Raises ChatTemplateError when the mask cannot be trusted."""
        if self.tagged:
            enc = self.tok.apply_chat_template(messages, chat_template=self.template, tokenize=True, return_dict=True,
                                               return_assistant_tokens_mask=True)
            return list(enc["input_ids"]), list(enc["assistant_masks"])
        full = self.render(messages)
        ids = self.encode_text(full)
        mask = [0] * len(ids)
        if not any(m["role"] == "assistant" for m in messages):
            return ids, mask
        self._require_header()
        end = self._require_end_of_turn()
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            s, e = self._turn_span(messages, i, full, end)
            a, b = self._token_index(full, ids, s, i), self._token_index(full, ids, e, i)
            for t in range(a, b):
                mask[t] = 1
        return ids, mask

    def _require_end_of_turn(self) -> TurnEnd:
        end = self.end_of_turn()
        if end is None:
            raise ChatTemplateError(
                "the template puts no special end-of-turn token after an assistant message's content, so neither the "
                "end of a turn nor a stop token can be found")
        return end

    def _turn_span(self, messages: list[dict], i: int, full: str, end: TurnEnd) -> tuple[int, int]:
        """(start, end) characters in `full` of assistant message i: from the first character after its header
        through its end-of-turn token (checks 1-3 of the module docstring)."""
        m = messages[i]
        after = self.render(messages[: i + 1])
        before = self._turn_prefix(messages, i, after)
        if not full.startswith(after):
            n = _first_difference(after, full)
            raise ChatTemplateError(
                f"message {i} (assistant): later messages change how this turn renders (at char {n}: "
                f"{_snip(after, n)} when it is the last message, {_snip(full, n)} in the whole conversation), "
                "e.g. the template drops earlier turns' reasoning; the whole conversation's tokens for this turn "
                "are not the ones the model produced for it", turn=i)
        if end.token in m["content"]:
            raise ChatTemplateError(f"message {i} (assistant): its content contains the end-of-turn token's text "
                                    f"{end.token!r}, so where the turn ends is ambiguous", turn=i, kind="sample")
        s = len(before)
        delta = after[s:]            # == full[s:len(after)] (checked above)
        j = full.find(end.token, s)
        # closed: the end-of-turn token lies within this turn's text, or follows it directly (a template that
        # renders the last message open and closes it once another message follows)
        if j < 0 or not (j + len(end.token) - s <= len(delta) or j - s == len(delta)):
            raise ChatTemplateError(
                f"message {i} (assistant): the turn {_snip(delta, 0)} is not closed by the end-of-turn token "
                f"{end.token!r} (the template leaves the last message open, or puts other text first)", turn=i)
        return s, j + len(end.token)

    def _turn_prefix(self, messages: list[dict], i: int, after: str) -> str:
        """The text before assistant message i's content, through its assistant header (`after`: the conversation
        rendered through message i)."""
        if i == 0:       # nothing before: the turn starts after the template's assistant header
            header = self.generation_prompt()
            h = after.find(header) if header else -1
            if h < 0:
                raise ChatTemplateError(
                    f"message 0 (assistant): the template's assistant header {header!r} does not appear in the "
                    f"rendered turn {_snip(after, 0)}", turn=i)
            return after[: h + len(header)]
        before = self.render(messages[:i], add_generation_prompt=True)
        if not after.startswith(before):
            n = _first_difference(before, after)
            raise ChatTemplateError(
                f"message {i} (assistant): the conversation before it rendered with the generation prompt is not "
                f"a prefix of the conversation with it (at char {n}: {_snip(before, n)} vs {_snip(after, n)}): "
                "the template opens an assistant turn differently from its generation prompt", turn=i)
        return before

    def _token_index(self, full: str, ids: list[int], at: int, turn: int) -> int:
        pre = self.encode_text(full[:at])
        if ids[: len(pre)] != pre:
            n = _first_difference(pre, ids)
            show = lambda xs: self.tok.convert_ids_to_tokens(xs[max(0, n - 2): n + 2])  # noqa: E731
            raise ChatTemplateError(
                f"message {turn} (assistant): the turn boundary at char {at} ({full[max(0, at - 24):at]!r} | "
                f"{full[at:at + 24]!r}) falls inside a token: the text before it ends in tokens {show(pre)}, the whole "
                f"conversation has {show(ids)} there, so the prompt a server tokenizes is not the start of this "
                "sample", turn=turn, kind="sample")
        return len(pre)


# ---------------------------------------------------------------------------------------------- stop tokens


def _as_list(v) -> list[int]:
    if v is None:
        return []
    if isinstance(v, int):
        return [v]
    return [int(x) for x in v if x is not None]


def resolve_stop_ids(tok, *, config_eos, generation_eos, template: str | None = None) -> dict:
    """Every token id that ends a generation, from config.json's and generation_config.json's `eos_token_id`
    (int or list), the tokenizer's eos and the chat template's end of turn. A candidate that is part of the
    template's assistant header (e.g. a converted tokenizer whose eos is ChatML's `<|im_start|>`) starts a turn:
    it is rejected, never used as a stop id. Returns {"eos_token_ids" (the template's end of turn first, when there
    is one), "end_of_turn", "sources", "rejected", "warnings"}."""
    size = len(tok)
    name = lambda i: tok.convert_ids_to_tokens(i) if 0 <= i < size else None  # noqa: E731
    end, header, header_text, notes = None, set(), "", []
    if template is not None or getattr(tok, "chat_template", None):
        try:
            r = ChatRenderer(tok, template)
            end = r.end_of_turn()
            header_text = r.generation_prompt()
            header = r.header_ids()
        except Exception as e:  # a template that cannot render a probe conversation: say so, keep the other sources
            notes.append(f"the chat template could not render a probe conversation ({type(e).__name__}: {str(e)[:200]}); "
                         "its end of turn is unknown")
    sources = {
        "chat_template": [end.token_id] if end else [],
        "config": _as_list(config_eos),
        "generation_config": _as_list(generation_eos),
        "tokenizer": _as_list(tok.eos_token_id),
    }
    ids: list[int] = []
    rejected: list[dict] = []
    for src, cands in sources.items():
        for i in cands:
            if i in ids or any(x["id"] == i for x in rejected):
                continue
            if not 0 <= i < size:
                rejected.append({"id": i, "token": None, "source": src, "why": f"not a token id of the tokenizer (size {size})"})
            elif i in header:
                rejected.append({"id": i, "token": name(i), "source": src,
                                 "why": f"it is part of the chat template's assistant header {header_text!r}: it starts a turn, "
                                        "it does not end one"})
            else:
                ids.append(i)
    warnings = list(notes)
    for x in rejected:
        warnings.append(f"{x['source']} eos {x['id']} ({x['token']}) is not used as a stop id: {x['why']}")
    declared = set(sources["config"]) | set(sources["generation_config"])
    if end and declared and end.token_id not in declared:
        warnings.append(f"the chat template ends a turn with {end.token} ({end.token_id}) but config.json/generation_config.json "
                        f"say eos {sorted(declared)}: an engine reading only those would generate past the end of a turn; "
                        "specpipe stops at both")
    return {"eos_token_ids": ids, "end_of_turn": {"id": end.token_id, "token": end.token} if end else None,
            "sources": sources, "rejected": rejected, "warnings": warnings}
