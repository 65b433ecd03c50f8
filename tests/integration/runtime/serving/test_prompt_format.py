"""Prompts and the chat template on the production Triton model (issue 22, defect 6).

Upstream (NVIDIA/TensorRT-LLM, the 1.2 line the tritonserver:26.07-trtllm-python-py3 image ships):
triton_backend/all_models/llmapi/tensorrt_llm/1/model.py (stored 044a90d209e380c95e23e8ae42f3583fa05ada78)
`_convert_request` passes `text_input` to `LLM.generate_async` as it is (no chat template, no option for one in
helpers.py stored 0df60f9ad779c4dc4f55da07e08b969fc4684e56); tensorrt_llm/inputs/registry.py DefaultInputProcessor
tokenizes it with `add_special_tokens=sampling_params.add_special_tokens`, True by default (tensorrt_llm/
sampling_params.py stored 000a01de66f0eab4ab05640711f0253f50f5209c). So clients must render the template themselves,
and the text they send must give validate's prompt_ids under add_special_tokens=True. The tokenizers here are real
(transformers' PreTrainedTokenizerFast over a `tokenizers` BPE), one of them adding a BOS like Llama-3's.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline.errors import UsageError
from stages import build, export

from conftest import TINY_CONFIG, run_cli, tiny_overrides
from support.synthetic import gate, run_stage, write_checkpoints

# a template that opens with the BOS, like Llama-3's
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SPECIALS = ["<s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]


def make_tokenizer(out: Path, *, adds_bos: bool):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    corpus = ["Write a Python function that adds two numbers.", "def add(a, b): return a + b", "hello world"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if adds_bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|end|>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(str(out))
    return fast


@pytest.mark.parametrize("adds_bos", [True, False])
def test_export_tells_clients_the_templated_text_that_gives_validates_tokens(tmp_path, adds_bos):
    from transformers import AutoTokenizer

    ck = write_checkpoints(tmp_path)
    tk = make_tokenizer(ck["target"], adds_bos=adds_bos)
    (tmp_path / "artifacts" / "data" / "chat_template.jinja").write_text(TEMPLATE)
    chat = [tk.apply_chat_template([{"role": "user", "content": f"code prompt {i}"}], tokenize=False,
                                   add_generation_prompt=True) for i in range(3)]     # what data writes for chat samples
    (tmp_path / "artifacts" / "data" / "eval" / "code.jsonl").write_text("".join(
        json.dumps({"id": f"code-{i}", "prompt": p, "prompt_ids": tk(p, add_special_tokens=False)["input_ids"]}) + "\n"
        for i, p in enumerate(chat)))
    gate(tmp_path, True)
    run_stage(tmp_path, build, build.Config())
    triton = run_stage(tmp_path, export, export.Config(speculators=False, cpu_repository=False)) / "triton"
    fmt = json.loads((triton / "prompt_format.json").read_text())
    assert (triton / "chat_template.jinja").read_text() == TEMPLATE
    assert fmt["chat_template"] == "chat_template.jinja" and fmt["tokenizer_adds_bos"] is adds_bos
    assert fmt["domains"] == {"code": "chat", "prose": "raw"}
    tok = AutoTokenizer.from_pretrained(str(triton / "tensorrt_llm" / "1" / "target_fp8"))
    rendered = tok.apply_chat_template(fmt["example_messages"], chat_template=TEMPLATE, tokenize=False,
                                       add_generation_prompt=True)
    validated = tok(rendered, add_special_tokens=False)["input_ids"]          # what data/validate use (prompt_ids)
    sent = fmt["example_text_input"]
    assert tok(sent, add_special_tokens=True)["input_ids"] == validated       # what TensorRT-LLM feeds the target
    assert sent.startswith("<|user|>") if adds_bos else sent == rendered
    readme = (triton / "README.md").read_text()
    assert "render the chat template before sending" in readme and "apply_chat_template" in readme
    assert "domains code; raw text, sent as it is: prose" in readme
    assert json.dumps(sent)[1:-1] in readme and "/v1/chat/completions" in readme
    assert ("removeprefix('<s>')" in readme) is adds_bos
    doc = json.loads((triton.parent / "export.json").read_text())
    assert doc["prompt_format"]["file"] == "triton/prompt_format.json"


def test_without_a_chat_template_clients_send_raw_text(tmp_path):
    write_checkpoints(tmp_path)
    gate(tmp_path, True)
    run_stage(tmp_path, build, build.Config())
    triton = run_stage(tmp_path, export, export.Config(speculators=False, cpu_repository=False)) / "triton"
    fmt = json.loads((triton / "prompt_format.json").read_text())
    assert fmt["chat_template"] is None and not (triton / "chat_template.jinja").exists()
    assert fmt["domains"] == {"code": "raw", "prose": "raw"}
    assert "send `text_input` as plain text" in (triton / "README.md").read_text()


def test_monitor_probes_with_the_text_clients_send_and_refuses_another_template(tmp_path):
    from pipeline import monitor
    from runtime.serving.prompt_format import describe, text_input_for

    tok = make_tokenizer(tmp_path / "tok", adds_bos=True)
    fmt = describe(tok, TEMPLATE, template_file="chat_template.jinja")
    rendered = tok.apply_chat_template([{"role": "user", "content": "hello world"}], tokenize=False,
                                       add_generation_prompt=True)
    assert rendered.startswith("<s>") and text_input_for(rendered, fmt) == rendered[len("<s>"):]
    assert text_input_for("hello world", fmt) == "hello world"           # raw text: as it is
    arts = tmp_path / "run" / "artifacts"
    (arts / "data").mkdir(parents=True)
    (arts / "data" / "chat_template.jinja").write_text(TEMPLATE)
    monitor.check_prompt_format(arts, fmt)                               # the same template: fine
    (arts / "data" / "chat_template.jinja").write_text(TEMPLATE.replace("<|end|>", "</s>"))
    with pytest.raises(UsageError, match="probes would not be what clients send"):
        monitor.check_prompt_format(arts, fmt)


# ---------------------------------------------------------------------------------------------- for real


@pytest.mark.slow
def test_monitor_probes_the_real_cpu_triton_with_chat_rendered_prompts(run_dir, tmp_path):
    """The tiny run with its `code` prompts rendered as conversations (as `data` writes chat samples), exported again by
    the CLI: export says code is chat and prose raw; `specpipe monitor` against the real CPU Triton serving the exported
    CPU repository probes both domains the way the README tells clients, and refuses once data's template changed."""
    from transformers import AutoTokenizer

    from runtime.serving import triton_server

    wd = tmp_path / "run"
    shutil.copytree(run_dir / "artifacts", wd / "artifacts", symlinks=True)
    data = wd / "artifacts" / "data"
    template = (data / "chat_template.jinja").read_text()
    tok = AutoTokenizer.from_pretrained(str(wd / "artifacts" / "export" / "triton_cpu" / "tensorrt_llm" / "1" / "target_fp8"))
    rows = [json.loads(line) for line in (data / "eval" / "code.jsonl").read_text().splitlines()]
    for r in rows:
        r["prompt"] = tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], chat_template=template,
                                              tokenize=False, add_generation_prompt=True)
        r["prompt_ids"] = tok(r["prompt"], add_special_tokens=False)["input_ids"]
    (data / "eval" / "code.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = run_cli("build", str(TINY_CONFIG), "--workdir", str(wd), *tiny_overrides(), "--only", "export", "--force", "export",
                timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    fmt = json.loads((wd / "artifacts" / "export" / "triton" / "prompt_format.json").read_text())
    assert fmt["domains"] == {"code": "chat", "prose": "raw"}
    repo = tmp_path / "repo"
    shutil.copytree(wd / "artifacts" / "export" / "triton_cpu", repo)
    srv = triton_server.start(repo, ready_timeout=180)
    try:
        args = ["monitor", "--workdir", str(wd), "--url", f"http://{srv.http_url}", "--once",
                "--state", str(tmp_path / "s.json"), "--prom-file", str(tmp_path / "m.prom")]
        r = run_cli(*args, timeout=600)
        print(r.stdout[-3000:], r.stderr[-1500:])
        assert r.returncode in (0, 1), r.stderr[-2000:]          # 1 would be a drift alarm: probes were answered
        assert "prompts as triton/README.md tells clients to send them (code chat, prose raw" in r.stdout
        assert "[code] AL" in r.stdout and "[prose] AL" in r.stdout
        (data / "chat_template.jinja").write_text(template.replace("<|end|>", "<|eot|>"))
        r = run_cli(*args, timeout=600)
        assert r.returncode == 2 and "probes would not be what clients send" in r.stderr
    finally:
        srv.stop()
