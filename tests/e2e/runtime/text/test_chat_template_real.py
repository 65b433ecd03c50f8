"""Assistant-only loss masks from real chat templates (runtime/text/chat_template.py), exact to the token, on the real
model's tokenizer (tests/e2e: `real_model`, prepared by `bash bench/real_model/prepare.sh`; the tiny target's
template and the syntax check: test_chat_template.py).

Templates: SmolLM2-135M-Instruct's own (the prepared model, `real_model`), and the shipped templates of
Llama-3.3-70B-Instruct, Qwen3 and vLLM's ChatML example, stored verbatim under tests/data/chat_templates/ (see its
README for repository, path and commit). The non-SmolLM2 templates are paired with SmolLM2's real tokenizer plus
the special tokens those templates use (the check is about the mask, not the vocabulary). Rendering follows
transformers 5.14.1 (`apply_chat_template`, installed).
"""
from __future__ import annotations

import pytest

from runtime.text.chat_template import ChatRenderer, ChatTemplateError, resolve_stop_ids

from support import DATA
from support.chat_masks import CHAT
from support.chat_masks import masked_runs as _runs
from support.chat_masks import unmasked as _unmasked

TEMPLATES = DATA / "chat_templates"

@pytest.fixture(scope="module")
def smol_dir(real_model):
    return real_model["model_dir"]


def _smol_tok(smol_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smol_dir)


# The pre-tokenizer split patterns of the real tokenizers (transformers 5.14.1, installed): Llama-3's is
# `convert_slow_tokenizer.TikTokenConverter`'s default pattern (what its tiktoken model converts with), Qwen3's is
# `models/qwen2/tokenization_qwen2.py` PRETOKENIZE_REGEX. They keep a run of newlines together ("\n\n" is one
# piece whatever follows); SmolLM2's GPT-2 pattern does not, which matters at a header ending in "\n\n".
LLAMA3_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def _with_split(tok, pattern: str):
    from tokenizers import Regex, pre_tokenizers

    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return tok


def _llama_specials(tok):
    tok.add_special_tokens({"bos_token": "<|begin_of_text|>",
                            "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                                                          "<|eom_id|>", "<|python_tag|>"]})
    return tok


@pytest.fixture(scope="module")
def llama_tok(smol_dir):
    """SmolLM2's vocabulary with Llama-3's pre-tokenizer split and the Llama-3 special tokens the template uses."""
    return _with_split(_llama_specials(_smol_tok(smol_dir)), LLAMA3_SPLIT)


@pytest.fixture(scope="module")
def qwen_tok(smol_dir):
    """SmolLM2's vocabulary (it has <|im_start|>/<|im_end|>) with Qwen's pre-tokenizer split and Qwen3's <think> and
    </think> as added, non-special tokens, as Qwen3's tokenizer has them."""
    from tokenizers import AddedToken

    tok = _with_split(_smol_tok(smol_dir), QWEN_SPLIT)
    tok.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    return tok


# ------------------------------------------------------------------------------------------ SmolLM2 (ChatML)


def test_smollm2_masks_every_assistant_turn_and_its_end_of_turn(smol_dir):
    tok = _smol_tok(smol_dir)
    r = ChatRenderer(tok)
    assert not r.tagged and r.method == "prefix_renderings"
    ids, mask = r.encode(CHAT)
    # the sample is the stock tokenization of the stock rendering
    assert ids == list(tok.apply_chat_template(CHAT, tokenize=True, return_dict=True)["input_ids"])
    assert _runs(tok, ids, mask) == [CHAT[1]["content"] + "<|im_end|>", CHAT[3]["content"] + "<|im_end|>"]
    # everything else is unmasked: the injected default system prompt, the user turns, the assistant headers and
    # the newline after each <|im_end|>
    system = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    expect = (system + "<|im_start|>user\n" + CHAT[0]["content"] + "<|im_end|>\n<|im_start|>assistant\n" + "\n"
              + "<|im_start|>user\n" + CHAT[2]["content"] + "<|im_end|>\n<|im_start|>assistant\n" + "\n")
    assert _unmasked(tok, ids, mask) == expect
    assert r.end_of_turn().token == "<|im_end|>" and r.end_of_turn().token_id == 2
    assert r.header_ids() == {1}                                 # <|im_start|> opens a turn


def test_smollm2_explicit_system_and_assistant_first(smol_dir):
    tok = _smol_tok(smol_dir)
    r = ChatRenderer(tok)
    chat = [{"role": "system", "content": "Be brief."}, *CHAT[:2]]
    ids, mask = r.encode(chat)
    assert _runs(tok, ids, mask) == [CHAT[1]["content"] + "<|im_end|>"]
    assert "Be brief." in _unmasked(tok, ids, mask) and "SmolLM" not in tok.decode(ids)
    # a conversation that starts with the assistant (a `text` sample rendered as a chat): the default system prompt
    # and the header stay unmasked
    ids, mask = r.encode([{"role": "assistant", "content": "def f():\n    return 1\n"}])
    assert _runs(tok, ids, mask) == ["def f():\n    return 1\n<|im_end|>"]
    assert _unmasked(tok, ids, mask).endswith("<|im_start|>assistant\n\n")


# ------------------------------------------------------------------------------------------ Llama-3 header style


def test_llama3_header_template_masks_content_and_eot(llama_tok):
    tok = llama_tok
    r = ChatRenderer(tok, (TEMPLATES / "llama-3.3-70b-instruct.jinja").read_text())
    chat = [{"role": "system", "content": "You are terse."}, *CHAT]
    chat[2] = {"role": "assistant", "content": "  7 times 6 is 42.\n"}      # the template trims content
    ids, mask = r.encode(chat)
    assert _runs(tok, ids, mask) == ["7 times 6 is 42.<|eot_id|>", CHAT[3]["content"] + "<|eot_id|>"]
    un = _unmasked(tok, ids, mask)
    assert un.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n")
    assert un.count("<|start_header_id|>assistant<|end_header_id|>\n\n") == 2 and "You are terse." in un
    assert "42.<|eot_id|>" not in un and "print(" not in un
    end = r.end_of_turn()
    assert end.token == "<|eot_id|>"
    assert {tok.convert_ids_to_tokens(i) for i in r.header_ids()} == {"<|start_header_id|>", "<|end_header_id|>"}
    # assistant first: the system header the template adds is not trained on
    ids, mask = r.encode([{"role": "assistant", "content": "Hi."}])
    assert _runs(tok, ids, mask) == ["Hi.<|eot_id|>"]


# ------------------------------------------------------------------------------------------ Qwen3 with <think>


def test_qwen3_single_turn_masks_reasoning_answer_and_end(qwen_tok):
    tok = qwen_tok
    r = ChatRenderer(tok, (TEMPLATES / "qwen3-0.6b.jinja").read_text())
    chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"}]
    ids, mask = r.encode(chat)
    assert _runs(tok, ids, mask) == ["<think>\nadd them\n</think>\n\n4<|im_end|>"]
    assert _unmasked(tok, ids, mask) == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n\n"
    # without reasoning the template writes an empty think block for the final turn: that is what it trains on
    ids, mask = r.encode([chat[0], {"role": "assistant", "content": "4"}])
    assert _runs(tok, ids, mask) == ["<think>\n\n</think>\n\n4<|im_end|>"]


def test_qwen3_multi_turn_is_detected_and_named(qwen_tok):
    """Qwen3's template renders an earlier assistant turn without its <think> block once a later user turn
    follows: the conversation's tokens for turn 1 are not what the model produced. Refused, never mis-masked."""
    r = ChatRenderer(qwen_tok, (TEMPLATES / "qwen3-0.6b.jinja").read_text())
    chat = [CHAT[0], {"role": "assistant", "content": "<think>\nmultiply\n</think>\n\n42."}, *CHAT[2:]]
    with pytest.raises(ChatTemplateError) as e:
        r.encode(chat)
    assert e.value.turn == 1 and e.value.kind == "template"
    msg = str(e.value)
    assert "message 1 (assistant)" in msg and "later messages change how this turn renders" in msg
    assert "<think>" in msg and "reasoning" in msg
    # also without reasoning: the final-turn rendering adds an empty think block an earlier turn does not have
    with pytest.raises(ChatTemplateError, match="later messages change"):
        r.encode(CHAT)


# ------------------------------------------------------------------------------------------ other shapes


def test_template_that_leaves_the_last_message_open_is_refused(smol_dir):
    """vLLM's example ChatML template closes a message with <|im_end|> only when another follows."""
    tok = _smol_tok(smol_dir)
    r = ChatRenderer(tok, (TEMPLATES / "vllm-chatml.jinja").read_text())
    assert r.end_of_turn().token == "<|im_end|>"          # found from [user, assistant, user]
    assert r.prompt_ids([CHAT[0]]) == tok("<|im_start|>user\nWhat is 7 times 6?<|im_end|>\n<|im_start|>assistant\n",
                                          add_special_tokens=False)["input_ids"]
    with pytest.raises(ChatTemplateError) as e:
        r.encode(CHAT)
    assert e.value.turn == 3 and "is not closed by the end-of-turn token '<|im_end|>'" in str(e.value)


def test_generation_prompt_that_is_not_the_turn_header_is_refused(smol_dir):
    """A template whose generation prompt opens the turn with text its rendered assistant turns do not have
    (DeepSeek-R1-style templates append '<think>\\n' to the generation prompt only)."""
    tmpl = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}")
    r = ChatRenderer(_smol_tok(smol_dir), tmpl)
    with pytest.raises(ChatTemplateError, match="message 1 .* opens an assistant turn differently from its generation prompt"):
        r.encode(CHAT[:2])


def test_token_across_the_header_boundary_is_a_sample_error(smol_dir):
    """Llama-3's header ends in "\n\n". SmolLM2's GPT-2 split makes that one token at the end of a prompt but two
    ("\n", "\n") before content: the prompt a server tokenizes is then not the start of the training sample. Found
    and named (a sample-level error: the data stage counts it against data.max_malformed), never mis-masked."""
    tok = _llama_specials(_smol_tok(smol_dir))
    r = ChatRenderer(tok, (TEMPLATES / "llama-3.3-70b-instruct.jinja").read_text())
    with pytest.raises(ChatTemplateError) as e:
        r.encode(CHAT[:2])
    assert e.value.kind == "sample" and e.value.turn == 1 and "falls inside a token" in str(e.value)
    msg = str(e.value)
    assert "('stant<|end_header_id|>\\n\\n' | '7 times 6 is 42.<|eot_id')" in msg
    assert "ends in tokens ['istant', '<|end_header_id|>', 'ĊĊ']" in msg
    assert "has ['istant', '<|end_header_id|>', 'Ċ', 'Ċ']" in msg


# ------------------------------------------------------------------------------------------ stop ids


def test_stop_ids_reject_a_turn_start_eos(smol_dir):
    """The GGUF conversion's tokenizer says eos <|im_start|> (1): it opens the assistant header, so it is rejected;
    the template's end of turn <|im_end|> (2), which config.json also says, is the stop id."""
    tok = _smol_tok(smol_dir)
    tok.eos_token = "<|im_start|>"
    assert tok.eos_token_id == 1
    res = resolve_stop_ids(tok, config_eos=2, generation_eos=[2])
    assert res["eos_token_ids"] == [2] and res["end_of_turn"] == {"id": 2, "token": "<|im_end|>"}
    assert res["rejected"] == [{"id": 1, "token": "<|im_start|>", "source": "tokenizer",
                                "why": "it is part of the chat template's assistant header '<|im_start|>assistant\\n': "
                                       "it starts a turn, it does not end one"}]
    assert any("<|im_start|>" in w for w in res["warnings"])
    # a config that does not declare the end of turn: both stop, and the disagreement is said
    res = resolve_stop_ids(_smol_tok(smol_dir), config_eos=0, generation_eos=None)
    assert res["eos_token_ids"] == [2, 0]
    assert any("ends a turn with <|im_end|> (2)" in w for w in res["warnings"])
