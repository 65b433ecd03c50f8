"""Assistant-only loss masks from the tiny target's chat template (runtime/text/chat_template.py): its
{% generation %} tags used exactly and the same mask by derivation without them; the template syntax check. The real
templates (SmolLM2's own, Llama-3.3, Qwen3, vLLM's ChatML) on the real tokenizer: test_chat_template_real.py."""
from __future__ import annotations

from runtime.text.chat_template import ChatRenderer, check_template_syntax

from support import DATA
from support.chat_masks import CHAT
from support.chat_masks import masked_runs as _runs

TEMPLATES = DATA / "chat_templates"


def test_generation_tags_are_used_exactly_and_agree_with_the_derivation(tmp_path):
    """The tiny target's template has {% generation %} tags: its mask is transformers' assistant mask, unchanged;
    the same template without the tags gives the same mask by derivation."""
    from runtime.target.corpus import CHAT_TEMPLATE, stdlib_corpus, train_tokenizer

    tok = train_tokenizer([t for _, t in stdlib_corpus(100_000)], 400, tmp_path)
    r = ChatRenderer(tok)
    assert r.tagged and r.method == "generation_tags"
    chat = [{"role": "system", "content": "sys"}, *CHAT]
    ids, mask = r.encode(chat)
    ref = tok.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert ids == list(ref["input_ids"]) and mask == list(ref["assistant_masks"])
    assert _runs(tok, ids, mask) == [CHAT[1]["content"] + "<|end|>", CHAT[3]["content"] + "<|end|>"]
    plain = ChatRenderer(tok, CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", ""))
    assert not plain.tagged and plain.encode(chat) == (ids, mask)


def test_template_syntax_check():
    assert check_template_syntax((TEMPLATES / "qwen3-0.6b.jinja").read_text()) is None
    assert check_template_syntax("{% generation %}{{ x }}{% endgeneration %}") is None
    assert "line 1" in check_template_syntax("{% for m in messages %}{{ m }}")
