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
versions (tests/runtime/text/tokenizer_probe.py) and compare ids, decoding and chat-template rendering.

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
from support import missing

TF457_ENV = "SPECPIPE_TF457_PYTHON"
DEFAULT_PY = REPO / ".venv-tf457" / "bin" / "python"
CREATE = "python3 -m venv .venv-tf457 && .venv-tf457/bin/pip install transformers==4.57.1 jinja2"
PROBE = Path(__file__).with_name("tokenizer_probe.py")
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
