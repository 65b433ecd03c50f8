"""Every tokenizer specpipe ships loads under the transformers each targeted TensorRT-LLM pins, and reads the same.

TensorRT-LLM 1.2.1 pins transformers==4.57.1 (NVIDIA/TensorRT-LLM requirements.txt on the 1.2 line, stored blob
000867d9b1ad62f3de1e54e111c094da492a5626: `transformers==4.57.1`, torch<=2.9.0, nvidia-modelopt~=0.37.0; the tag v1.2.1
is the branch release/1.2.1 that tensorrtllm_backend r26.04-r26.07's Dockerfile builds). The 1.3 line runs
transformers 5 (PR #12829 "Upgrade transformers dependency to 5.3.0", then #13994 -> 5.5.3 and #14456 -> 5.5.4,
merged to main before the 1.3.0rc tags specpipe targets): the project's own transformers 5 is that side.

transformers 5 writes `"tokenizer_class": "TokenizersBackend"`, which 4.57.1's AutoTokenizer cannot resolve
(transformers v4.57.1 models/auto/tokenization_auto.py AutoTokenizer.from_pretrained: "Tokenizer class
TokenizersBackend does not exist or is not currently imported"), and TensorRT-LLM's `load_hf_tokenizer` then returns
None. runtime/text/tokenizer_files.py writes the portable form; these tests load each shipped tokenizer in both
versions (tests/support/tokenizer_probe.py) and compare ids, decoding and chat-template rendering.

The 4.57.1 python: SPECPIPE_TF457_PYTHON (.ci/run builds .venv-tf457); missing: a failure under CI=true, a skip elsewhere.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import REPO
from support import SUPPORT, missing

TF457_ENV = "SPECPIPE_TF457_PYTHON"
DEFAULT_PY = REPO / ".venv-tf457" / "bin" / "python"
CREATE = "python3 -m venv .venv-tf457 && .venv-tf457/bin/pip install transformers==4.57.1 jinja2"
PROBE = SUPPORT / "tokenizer_probe.py"
# Stage directories whose model directories a deployment loads: the FP8 target (trtllm-serve, vLLM), the drafts,
# build's renamed draft, both Triton repositories and the speculators export.
SHIPPED = ("quantize", "train_draft", "build", "export")


def tf457_python() -> str:
    py = os.environ.get(TF457_ENV) or str(DEFAULT_PY)
    if Path(py).is_file():
        return py
    msg = (f"the transformers 4.57.1 venv is missing ({TF457_ENV}={os.environ.get(TF457_ENV)!r}, default {DEFAULT_PY}); "
           f"create it from the repository root with: {CREATE}")
    missing(msg)


def probe(python: str, dirs: list[Path]) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run([python, str(PROBE), *map(str, dirs)], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def assert_same_in_both(dirs: list[Path]) -> dict:
    """Each directory loads under transformers 4.57.1 and gives what transformers 5 gives (the class name aside:
    4.57.1's PreTrainedTokenizerFast is transformers 5's TokenizersBackend)."""
    assert dirs
    old, new = probe(tf457_python(), dirs), probe(sys.executable, dirs)
    errors = {d: r["error"] for d, r in old.items() if "error" in r}
    assert not errors, f"transformers 4.57.1 (TensorRT-LLM 1.2.1's pin) cannot load: {errors}"
    assert not [d for d, r in new.items() if "error" in r], new
    for d in old:
        a = {k: v for k, v in old[d].items() if k != "class"}
        b = {k: v for k, v in new[d].items() if k != "class"}
        diff = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        assert not diff, f"{d}: transformers 4.57.1 and 5 differ in {diff}: " + "; ".join(
            f"{k}: {str(a.get(k))[:200]} vs {str(b.get(k))[:200]}" for k in diff)
        assert old[d]["class"] == "PreTrainedTokenizerFast", old[d]["class"]
    return old


def shipped_tokenizers(run: Path) -> list[Path]:
    arts = run / "artifacts"
    return sorted({p.parent for s in SHIPPED for p in (arts / s).rglob("tokenizer_config.json")})


def test_every_shipped_tokenizer_of_the_tiny_run_reads_the_same_under_transformers_4_57_1(run_dir):
    dirs = shipped_tokenizers(run_dir)
    rel = {str(d.relative_to(run_dir / "artifacts")) for d in dirs}
    # the deployed target, the Triton repositories' target and draft, the draft TensorRT-LLM loads
    for must in ("quantize/target_fp8", "export/triton/tensorrt_llm/1/target_fp8", "export/triton/tensorrt_llm/1/draft",
                 "export/triton_cpu/tensorrt_llm/1/target_fp8", "train_draft/draft"):
        assert must in rel, sorted(rel)
    got = assert_same_in_both(dirs)
    # the chat renderings were among what was compared: the deployed target ships a template
    assert got[str(run_dir / "artifacts" / "quantize" / "target_fp8")]["has_chat_template"]


def test_the_real_models_tokenizer_as_quantize_ships_it_reads_the_same(real_model, tmp_path):
    """SmolLM2-135M-Instruct, saved by transformers 5 (TokenizersBackend, clean_up_tokenization_spaces true on a BPE
    model), copied the way quantize writes the deployed target's tokenizer."""
    from runtime.quant.export import copy_tokenizer

    src = Path(real_model["model_dir"])
    out = tmp_path / "target_fp8"
    out.mkdir()
    copy_tokenizer(src, out)
    assert assert_same_in_both([out])[str(out)]["has_chat_template"]


def _saved_by_transformers5(d: Path) -> Path:
    """A BPE tokenizer with extra special tokens (Llama-3.x style headers) saved by the project's transformers 5, which
    writes them as a list: `"extra_special_tokens": [...]`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(["hello world, a test of a tokenizer: def add(a, b): return a+b"] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|begin_of_text|>", "<|eot_id|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    t = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                pad_token="<|pad|>",
                                extra_special_tokens=["<|start_header_id|>", "<|end_header_id|>", "<|python_tag|>"])
    t.chat_template = ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>{{ m['content'] }}"
                       "<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>"
                       "{% endif %}")
    t.save_pretrained(str(d))
    return d


def test_a_transformers5_tokenizer_with_extra_special_tokens_reads_the_same_under_4_57_1(tmp_path):
    """transformers 5 writes extra special tokens as a list; 4.57.1 wants a dict (_set_model_specific_special_tokens
    calls .keys()) and cannot load the file. The portable form moves the list to additional_special_tokens, which both
    read alike."""
    from runtime.text.tokenizer_files import portable_tokenizer

    raw = _saved_by_transformers5(tmp_path / "raw")
    cfg = json.loads((raw / "tokenizer_config.json").read_text())
    assert isinstance(cfg["extra_special_tokens"], list)          # what transformers 5 writes
    out = tmp_path / "portable"
    shutil.copytree(raw, out)
    assert portable_tokenizer(out)
    new = json.loads((out / "tokenizer_config.json").read_text())
    assert "extra_special_tokens" not in new
    assert new["additional_special_tokens"] == ["<|start_header_id|>", "<|end_header_id|>", "<|python_tag|>"]
    old, five = probe(tf457_python(), [raw, out]), probe(sys.executable, [raw, out])   # one process per version
    assert "error" in old[str(raw)]                               # 4.57.1 cannot load it as transformers 5 saved it
    assert "error" not in old[str(out)], old[str(out)]
    assert five[str(raw)] == five[str(out)]                       # transformers 5 reads the portable file unchanged
    a, b = ({k: v for k, v in r[str(out)].items() if k != "class"} for r in (old, five))
    assert a == b, sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    assert a["has_chat_template"] and len(a["all_special_ids"]) == 6


def test_portable_config_rules():
    from runtime.text.tokenizer_files import portable_config

    bpe = {"model": {"type": "BPE"}}
    cfg = {"tokenizer_class": "TokenizersBackend", "clean_up_tokenization_spaces": True, "backend": "tokenizers"}
    assert portable_config(cfg, bpe) == {"tokenizer_class": "PreTrainedTokenizerFast",
                                         "clean_up_tokenization_spaces": False, "backend": "tokenizers"}
    # WordPiece: transformers 5 cleans up too, so the flag stays; without tokenizer.json the class cannot be rewritten
    wp = {"tokenizer_class": "TokenizersBackend", "clean_up_tokenization_spaces": True}
    assert portable_config(wp, {"model": {"type": "WordPiece"}}) == {**wp, "tokenizer_class": "PreTrainedTokenizerFast"}
    assert portable_config(wp, None) == wp
    assert portable_config({"tokenizer_class": "LlamaTokenizer"}, bpe) == {"tokenizer_class": "LlamaTokenizer"}
    # transformers 5's list of extra special tokens joins any additional_special_tokens; a dict (named tokens) stays
    assert portable_config({"extra_special_tokens": ["<b>", "<a>"], "additional_special_tokens": ["<a>"]}, None) == \
        {"additional_special_tokens": ["<a>", "<b>"]}
    named = {"extra_special_tokens": {"image_token": "<img>"}}
    assert portable_config(named, None) == named


def test_rewriting_a_hard_linked_tokenizer_leaves_the_source_alone(tmp_path):
    from runtime.text.tokenizer_files import portable_tokenizer

    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    (src / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TokenizersBackend"}))
    (src / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE"}}))
    for n in ("tokenizer_config.json", "tokenizer.json"):
        os.link(src / n, dst / n)
    assert portable_tokenizer(dst)
    assert json.loads((dst / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert json.loads((src / "tokenizer_config.json").read_text())["tokenizer_class"] == "TokenizersBackend"
    assert not portable_tokenizer(dst)       # idempotent
    shutil.rmtree(dst)
