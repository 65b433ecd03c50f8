"""Versions the deployment notes state: which TensorRT-LLM each Triton image pins, and which vLLM captures the target's
final hidden state (an EAGLE-3 capture id equal to the number of target layers, the tiny draft's vLLM id 4 of 4).

Upstream sources:
- triton-inference-server/tensorrtllm_backend, dockerfile/Dockerfile.triton.trt_llm_backend on branches r25.12 ...
  r26.07 (head commits in runtime/trtllm/compat.py TRITON_DOCKERFILES): `ARG TENSORRTLLM_VER`; r26.03 (9736c4df) pins
  1.2.0rc8 from release/1.2, r26.04 (ce68ff5f) onwards 1.2.1 from release/1.2.1.
- vllm-project/vllm 8b346309a5efbe80ee64f7d3633d2d7dedcc202b (PR #36063, merged 2026-03-13, first released in 0.18.0):
  vllm/model_executor/models/llama.py LlamaModel.forward calls `self._maybe_add_hidden_state(aux_hidden_states,
  idx + 1, hidden_states, residual)` after each layer (and id 0 before the first), and
  vllm/model_executor/models/interfaces.py EagleModelMixin._maybe_add_hidden_state appends hidden_states + residual when
  the id is in aux_hidden_state_layers; read in the released vLLM 0.32.0. Before it, the state entering layer i was
  captured as id i, so an id equal to the layer count was never captured.
"""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from conftest import REPO
from support import missing

VLLM_ENV = "SPECPIPE_VLLM_PYTHON"


def test_the_triton_images_pin_the_versions_their_dockerfiles_say():
    from runtime.trtllm import compat

    by_tag = {c.image.split(":")[1].split("-")[0]: c.trtllm_version for c in compat.CONTAINERS if c.kind == "triton"}
    assert by_tag["26.03"] == "1.2.0rc8"                       # not 1.2.0: Dockerfile r26.03 TENSORRTLLM_VER
    for tag, (commit, repo_tag, ver) in compat.TRITON_DOCKERFILES.items():
        assert re.fullmatch(r"[0-9a-f]{40}", commit)
        assert by_tag[tag] == ver, (tag, by_tag[tag], ver)
        assert repo_tag.startswith("release/")
    assert set(by_tag) == set(compat.TRITON_DOCKERFILES)
    assert compat.triton_image_for("1.2.0") is None            # no Triton image ships 1.2.0 itself
    assert compat.triton_image_for("1.2.0rc8") == "nvcr.io/nvidia/tritonserver:26.03-trtllm-python-py3"
    assert compat.triton_image_for("1.2.1") == compat.SHIPPED_TRITON_IMAGE


def test_the_final_layer_capture_note_names_the_minimum_vllm():
    from runtime.vllm.speculators_config import VLLM_MIN_FINAL_LAYER_CAPTURE, eagle3_notes

    assert VLLM_MIN_FINAL_LAYER_CAPTURE == "0.18.0"
    notes = " ".join(eagle3_notes([1, 2, 4], [0, 1, 3], 4))     # the tiny draft: ids 1, 2, 4 of 4 layers
    assert "vLLM >= 0.18.0" in notes and "capture id 4" in notes and "8b346309" in notes
    assert not any("capture id" in n for n in eagle3_notes([1, 2, 3], [0, 1, 2], 4))


def test_the_tiny_exports_readme_states_it(run_dir):
    """The tiny run's speculators export captures the final layer (id 4 of 4): its README says which vLLM reads it."""
    readme = (Path(run_dir) / "artifacts" / "export" / "speculators" / "README.md").read_text()
    assert "vLLM >= 0.18.0" in readme


def vllm_source_dir() -> Path:
    py = os.environ.get(VLLM_ENV) or str(REPO / ".venv-vllm" / "bin" / "python")
    if not Path(py).is_file():
        msg = f"no vLLM python ({VLLM_ENV}={os.environ.get(VLLM_ENV)!r}); point {VLLM_ENV} at a venv with vllm"
        missing(msg)
    code = "import importlib.util as u; print(u.find_spec('vllm').submodule_search_locations[0])"   # no vllm import
    r = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return Path(r.stdout.strip())


def test_the_installed_vllm_captures_after_each_layer():
    """The rule the note encodes, read from the installed vLLM's source (0.32.0 here; >= 0.18.0 is required)."""
    src = vllm_source_dir()
    version = re.search(r"__version__ = version = '([^']+)'", (src / "_version.py").read_text()).group(1)
    assert tuple(int(x) for x in version.split(".")[:2]) >= (0, 18), version
    llama = (src / "model_executor" / "models" / "llama.py").read_text()
    forward = llama[llama.index("class LlamaModel"):]
    forward = forward[forward.index("def forward"):forward.index("def load_weights")]
    layer_call = forward.index("= layer(")
    capture = forward.index("aux_hidden_states, idx + 1, hidden_states, residual")
    assert capture > layer_call, "the capture after layer idx is id idx + 1"
    mixin = (src / "model_executor" / "models" / "interfaces.py").read_text()
    body = mixin[mixin.index("def _maybe_add_hidden_state"):]
    body = body[:body.index("return aux_hidden_states")]
    assert "if layer_idx in self.aux_hidden_state_layers" in body and "hidden_states + residual" in body
