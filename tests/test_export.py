"""Stage `export`: the production (LLM-API) and CPU Triton repositories, checked without a server.

Runs `build` then `export` on synthetic upstream artifacts (see test_build.write_checkpoints); the checks
that need a running server are in test_serve.py.
"""
from __future__ import annotations

import json
import logging
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from pipeline.errors import StageError
from pipeline.stage import Artifact, StageContext
from runtime import trtllm_options as T
from stages import build, export
from test_build import write_checkpoints


def run_stage(root: Path, module, section) -> Path:
    """Run a stage module on the artifacts under root/artifacts and move its output into place."""
    arts = root / "artifacts"
    out = root / ".tmp" / module.NAME
    out.mkdir(parents=True)
    inputs = {n: Artifact(n, arts / n, {"fingerprint": n, "metrics": {}}) for n in module.CONSUMES}
    ctx = StageContext(name=module.NAME, config=SimpleNamespace(hardware=SimpleNamespace(tensor_parallel_size=1)),
                       section=section, out_dir=out, scratch_dir=root / "scratch", inputs=inputs, workdir=root,
                       fingerprint="x", log=logging.getLogger(f"test.{module.NAME}"))
    module.run(ctx)
    out.rename(arts / module.NAME)
    return arts / module.NAME


def gate(root: Path, passed: bool) -> None:
    (root / "artifacts" / "validate").mkdir(parents=True, exist_ok=True)
    (root / "artifacts" / "validate" / "acceptance.json").write_text(json.dumps(
        {"gates": {"passed": passed, "code": {"measured": 1.4 if not passed else 2.6, "required": 2.0}}}))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    ck = write_checkpoints(root)
    gate(root, True)
    run_stage(root, build, build.Config())
    # the synthetic draft has no real shapes to write in the speculators format: tests/test_speculators.py covers it
    return root, run_stage(root, export, export.Config(speculators=False)), ck


def parse(p: Path):
    return text_format.Parse(p.read_text(), model_config_pb2.ModelConfig())


def test_export_refuses_when_the_gate_failed(tmp_path):
    write_checkpoints(tmp_path)
    gate(tmp_path, False)
    run_stage(tmp_path, build, build.Config())
    with pytest.raises(StageError, match="gate did not pass.*measured.*1.4"):
        run_stage(tmp_path, export, export.Config())
    assert not (tmp_path / "artifacts" / "export").exists()


def test_every_config_pbtxt_parses_with_tritons_model_config(exported):
    _, out, _ = exported
    paths = sorted(out.rglob("config.pbtxt"))
    assert [p.relative_to(out).as_posix() for p in paths] == ["triton/tensorrt_llm/config.pbtxt",
                                                              "triton_cpu/tensorrt_llm/config.pbtxt"]
    io = T.load_schema("triton-llmapi-model")["config_pbtxt"]
    for p in paths:
        cfg = parse(p)
        assert cfg.name == "tensorrt_llm" and cfg.backend == "python"
        assert [i.name for i in cfg.input] == [i["name"] for i in io["inputs"]]
        assert [o.name for o in cfg.output] == [o["name"] for o in io["outputs"]]
        assert {o.name: model_config_pb2.DataType.Name(o.data_type) for o in cfg.output}["acceptance_rate"] == "TYPE_FP32"
    cpu = parse(out / "triton_cpu" / "tensorrt_llm" / "config.pbtxt")
    assert cpu.model_transaction_policy.decoupled and cpu.max_batch_size == 0
    prod = parse(out / "triton" / "tensorrt_llm" / "config.pbtxt")
    assert not prod.HasField("model_transaction_policy")   # the container's model.py takes it from model.yaml


def test_a_broken_config_is_a_parse_error_with_its_position(tmp_path):
    p = tmp_path / "config.pbtxt"
    p.write_text('name: "m"\nbackend: "python"\ninput { name: "x" data_type: TYPE_INT33 dims: [ 1 ] }\n')
    with pytest.raises(StageError, match=r"3:\d+.*TYPE_INT33"):
        export.check_pbtxt([p])


def test_model_yaml_is_the_llm_api_options_plus_triton_config(exported):
    root, out, ck = exported
    body = yaml.safe_load((out / "triton" / "tensorrt_llm" / "1" / "model.yaml").read_text())
    assert T.unknown_keys(body, "1.2.1", model_yaml=True) == []
    assert body["triton_config"] == {"max_batch_size": 0, "decoupled": True, "cancellation_check_period_ms": 100}
    assert body["model"] == "/opt/specpipe/triton/tensorrt_llm/1/target_fp8" and body["backend"] == "pytorch"
    assert body["speculative_config"]["speculative_model"] == "/opt/specpipe/triton/tensorrt_llm/1/draft"
    opts = yaml.safe_load((root / "artifacts" / "build" / "deployment" / "llm_api_options.yaml").read_text())
    for k, v in opts.items():       # everything else is exactly what build wrote
        if k != "speculative_config":
            assert body[k] == v
    # the checkpoints are inside the repository (hard links of the committed artifacts)
    for name, src in (("target_fp8", ck["target"]), ("draft", ck["draft"])):
        d = out / "triton" / "tensorrt_llm" / "1" / name
        assert (d / "config.json").stat().st_ino == (src / "config.json").stat().st_ino
    assert (out / "triton" / "tensorrt_llm" / "1" / "target_fp8" / "hf_quant_config.json").exists()


def test_launch_script_and_readme_explain_the_container(exported):
    _, out, _ = exported
    launch = out / "triton" / "launch.sh"
    subprocess.run(["bash", "-n", str(launch)], check=True)
    text = launch.read_text()
    assert "/app/all_models/llmapi/tensorrt_llm/1" in text and "launch_triton_server.py" in text
    readme = (out / "triton" / "README.md").read_text()
    assert "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3" in readme and "docker run --gpus all" in readme
    assert "model.py" in readme and "helpers.py" in readme


def test_cpu_repository_carries_the_model_and_its_spec(exported):
    _, out, _ = exported
    mdir = out / "triton_cpu" / "tensorrt_llm" / "1"
    from importlib import resources

    assert (mdir / "model.py").read_text() == resources.files("runtime").joinpath("triton_model", "model.py").read_text()
    spec = json.loads((mdir / "specpipe_model.json").read_text())
    assert spec["target"] == "target_fp8" and spec["draft"] == "draft" and spec["draft_len"] == 4
    assert (mdir / spec["target"] / "hf_quant_config.json").exists() and (mdir / spec["draft"] / "config.json").exists()
    doc = json.loads((out / "export.json").read_text())
    assert set(doc["config_pbtxt"].values()) == {"parsed"}


def test_dflash_exports_for_1_3_with_a_custom_image_note(tmp_path):
    write_checkpoints(tmp_path, algorithm="dflash")
    gate(tmp_path, True)
    with pytest.raises(StageError, match="DFlash needs TensorRT-LLM 1.3"):
        run_stage(tmp_path, build, build.Config())            # 1.2.1 default: refused at run time too
    shutil.rmtree(tmp_path / ".tmp")
    run_stage(tmp_path, build, build.Config(trtllm_version="1.3.0rc27"))
    out = run_stage(tmp_path, export, export.Config(speculators=False))
    body = yaml.safe_load((out / "triton" / "tensorrt_llm" / "1" / "model.yaml").read_text())
    sc = body["speculative_config"]
    assert sc["decoding_type"] == "DFlash" and "eagle3_one_model" not in sc and "eagle3_layers_to_capture" not in sc
    assert T.unknown_keys(body, "1.3.0rc27", model_yaml=True) == []
    assert "custom Triton image built on nvcr.io/nvidia/tensorrt-llm/release:1.3.0rc27" in (out / "triton" / "README.md").read_text()
    assert json.loads((out / "export.json").read_text())["triton_image"] is None


def test_serve_without_an_export_is_a_usage_error(tmp_path):
    from conftest import run_cli

    r = run_cli("serve", "--workdir", str(tmp_path))
    assert r.returncode == 2 and "no committed export with a CPU repository" in r.stderr
