"""Stage `export`: the production (LLM-API) and CPU Triton repositories, checked without a server.

Runs `build` then `export` on synthetic upstream artifacts (tests/support/synthetic.py `write_checkpoints`), on the tiny
pipeline's real artifacts (the session's `tiny_run`) and on the real model (SmolLM2-135M-Instruct, exported by
ModelOpt here); the checks that need a running server are in test_serve.py.
"""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from tritonclient.grpc import model_config_pb2

from pipeline.errors import StageError
from runtime.trtllm import draft_weights, schema
from stages import build, export

from support import triton_model_config as parse
from support.synthetic import Upstream, gate, run_stage, write_checkpoints


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    ck = write_checkpoints(root)
    gate(root, True)
    run_stage(root, build, build.Config())
    # the synthetic draft has no real shapes to write in the speculators format:
    # tests/e2e/runtime/vllm/test_speculators.py covers it
    return root, run_stage(root, export, export.Config(speculators=False)), ck


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
    io = schema.load_schema("triton-llmapi-model")["config_pbtxt"]
    for p in paths:
        cfg = parse(p)
        assert cfg.name == "tensorrt_llm" and cfg.backend == "python"
        assert [i.name for i in cfg.input] == [i["name"] for i in io["inputs"]]
        assert [o.name for o in cfg.output] == [o["name"] for o in io["outputs"]]
        assert {o.name: model_config_pb2.DataType.Name(o.data_type) for o in cfg.output}["acceptance_rate"] == "TYPE_FP32"
    cpu = parse(out / "triton_cpu" / "tensorrt_llm" / "config.pbtxt")
    assert cpu.model_transaction_policy.decoupled and cpu.max_batch_size == 0


def test_production_config_pbtxt_states_decoupled_and_max_batch_size(exported):
    """Defect 2: the container's launcher always passes --disable-auto-complete-config
    (triton_backend/scripts/launch_triton_server.py stored 0a2e2c1f1268b343), so model.py's auto_complete_config,
    the only place that copies model.yaml's triton_config into the model config (all_models/llmapi/tensorrt_llm/1/
    model.py stored 044a90d2), never runs: config.pbtxt itself must say decoupled and max_batch_size."""
    _, out, _ = exported
    prod = parse(out / "triton" / "tensorrt_llm" / "config.pbtxt")
    body = yaml.safe_load((out / "triton" / "tensorrt_llm" / "1" / "model.yaml").read_text())
    assert prod.HasField("model_transaction_policy") and prod.model_transaction_policy.decoupled is True
    assert prod.max_batch_size == body["triton_config"]["max_batch_size"] == 0
    assert body["triton_config"]["decoupled"] is True


def test_a_broken_config_is_a_parse_error_with_its_position(tmp_path):
    p = tmp_path / "config.pbtxt"
    p.write_text('name: "m"\nbackend: "python"\ninput { name: "x" data_type: TYPE_INT33 dims: [ 1 ] }\n')
    with pytest.raises(StageError, match=r"3:\d+.*TYPE_INT33"):
        export.check_pbtxt([p])


def test_model_yaml_is_the_llm_api_options_plus_triton_config(exported):
    root, out, ck = exported
    body = yaml.safe_load((out / "triton" / "tensorrt_llm" / "1" / "model.yaml").read_text())
    assert schema.unknown_keys(body, "1.2.1", model_yaml=True) == []
    assert body["triton_config"] == {"max_batch_size": 0, "decoupled": True, "cancellation_check_period_ms": 100}
    assert body["model"] == "/opt/specpipe/triton/tensorrt_llm/1/target_fp8" and body["backend"] == "pytorch"
    assert body["speculative_config"]["speculative_model"] == "/opt/specpipe/triton/tensorrt_llm/1/draft"
    opts = yaml.safe_load((root / "artifacts" / "build" / "deployment" / "llm_api_options.yaml").read_text())
    for k, v in opts.items():       # everything else is exactly what build wrote
        if k != "speculative_config":
            assert body[k] == v
    assert body["speculative_config"]["eagle3_layers_to_capture"] == ck["aux"]
    # the checkpoints are inside the repository (hard links of the committed artifacts): the target, and the draft
    # TensorRT-LLM 1.2.1 loads (build's copy with midlayer.* names)
    tdraft = root / "artifacts" / "build" / "deployment" / "draft"
    for name, src in (("target_fp8", ck["target"]), ("draft", tdraft)):
        d = out / "triton" / "tensorrt_llm" / "1" / name
        assert (d / "config.json").stat().st_ino == (src / "config.json").stat().st_ino
    names = draft_weights.safetensors_tensors(out / "triton" / "tensorrt_llm" / "1" / "draft" / "model.safetensors")
    assert not [n for n in names if n.startswith("layers.")] and "midlayer.hidden_norm.weight" in names
    cpu = draft_weights.safetensors_tensors(out / "triton_cpu" / "tensorrt_llm" / "1" / "draft" / "model.safetensors")
    assert "layers.0.hidden_norm.weight" in cpu           # specpipe's runtime reads ModelOpt's names
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

    assert (mdir / "model.py").read_text() == resources.files("runtime.serving").joinpath("triton_model", "model.py").read_text()
    spec = json.loads((mdir / "specpipe_model.json").read_text())
    assert spec["target"] == "target_fp8" and spec["draft"] == "draft" and spec["draft_len"] == 4
    assert spec["draft_schedule"] == {"runs": [[1, 16, 4]]}
    assert (mdir / spec["target"] / "hf_quant_config.json").exists() and (mdir / spec["draft"] / "config.json").exists()
    doc = json.loads((out / "export.json").read_text())
    assert set(doc["config_pbtxt"].values()) == {"parsed"}


def test_dflash_exports_for_1_3_with_a_custom_image_note(tmp_path):
    write_checkpoints(tmp_path, Upstream(algorithm="dflash", version="1.3.0rc27"))
    gate(tmp_path, True)
    with pytest.raises(StageError, match="DFlash needs TensorRT-LLM 1.3"):
        run_stage(tmp_path, build, build.Config())            # 1.2.1 default: refused at run time too
    shutil.rmtree(tmp_path / ".tmp")
    run_stage(tmp_path, build, build.Config(trtllm_version="1.3.0rc27"))
    out = run_stage(tmp_path, export, export.Config(speculators=False))
    body = yaml.safe_load((out / "triton" / "tensorrt_llm" / "1" / "model.yaml").read_text())
    sc = body["speculative_config"]
    assert sc["decoding_type"] == "DFlash" and "eagle3_one_model" not in sc and "eagle3_layers_to_capture" not in sc
    assert schema.unknown_keys(body, "1.3.0rc27", model_yaml=True) == []
    readme = (out / "triton" / "README.md").read_text()
    assert "custom Triton image built on nvcr.io/nvidia/tensorrt-llm/release:1.3.0rc27" in readme
    assert json.loads((out / "export.json").read_text())["triton_image"] is None


def test_export_without_speculation(tmp_path):
    """Defect 7 end to end: tune says speculation never pays; build deploys the target alone; export writes both
    repositories without a draft, and says why."""
    write_checkpoints(tmp_path, Upstream(runs=[[1, 16, 0]]))
    gate(tmp_path, True)
    run_stage(tmp_path, build, build.Config())
    out = run_stage(tmp_path, export, export.Config())
    mdir = out / "triton" / "tensorrt_llm" / "1"
    body = yaml.safe_load((mdir / "model.yaml").read_text())
    assert "speculative_config" not in body and not (mdir / "draft").exists() and (mdir / "target_fp8").exists()
    assert schema.unknown_keys(body, "1.2.1", model_yaml=True) == []
    spec = json.loads((out / "triton_cpu" / "tensorrt_llm" / "1" / "specpipe_model.json").read_text())
    assert spec["draft"] is None and spec["draft_len"] == 0
    assert not (out / "triton_cpu" / "tensorrt_llm" / "1" / "draft").exists()
    assert "No draft" in (out / "triton" / "README.md").read_text()
    assert json.loads((out / "export.json").read_text())["speculation"] is False
    assert all(v == "parsed" for v in json.loads((out / "export.json").read_text())["config_pbtxt"].values())


def test_serve_without_an_export_is_a_usage_error(tmp_path):
    from conftest import run_cli

    r = run_cli("serve", "--workdir", str(tmp_path))
    assert r.returncode == 2 and "no committed export with a CPU repository" in r.stderr


def test_export_ships_monitoring_and_the_served_identity(exported):
    """monitoring/ (rules and dashboards per engine, from the exported profile's baseline) and export.json's
    served_identity, which `specpipe monitor --served-target/--served-draft` compares with what is served."""
    from pipeline.monitor_diagnosis import model_identity

    _, out, _ = exported
    doc = json.loads((out / "export.json").read_text())
    mon = doc["monitoring"]
    assert mon["engines"] == ["triton", "vllm", "trtllm", "sglang"] and 1 <= mon["alarm_boundary"] < mon["acceptance_length"]
    assert all((out / f).is_file() for f in mon["files"]) and len(mon["files"]) == 9
    dep = json.loads((out.parent / "build" / "deployment.json").read_text())
    ident = doc["served_identity"]
    assert ident["target"] == model_identity(Path(dep["target_dir"])) and ident["target"]["config"]
    assert ident["draft"] == model_identity(Path(dep["trtllm_draft_dir"]))
    if shutil.which("promtool"):
        r = subprocess.run(["promtool", "check", "rules", *(str(out / f) for f in mon["files"] if f.endswith(".yml"))],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr


def test_speculators_verifier_is_what_the_serving_side_names_not_a_build_host_path(tmp_path, caplog):
    """speculators/config.json verifier.name_or_path is published with the draft: a hub target's id (what `vllm serve
    <draft>` and the speculators library then open), export.speculators_verifier where given, and the build-host path
    only as the last resort, with a warning naming the setting."""
    import logging
    from types import SimpleNamespace

    from support import REPO, TINY_CONFIG, real_config

    dep = SimpleNamespace(target_dir=str(tmp_path / "artifacts" / "quantize" / "target_fp8"))

    def name(config, **sec):
        ctx = SimpleNamespace(config=real_config(config=config), section=export.Config(**sec),
                              log=logging.getLogger("test.export"))
        return export._verifier_name(ctx, dep)

    hub = REPO / "configs" / "llama70b_fp8_eagle3.yaml"
    assert name(hub) == real_config(config=hub).target.model and "/" in name(hub)   # its hub id
    assert name(hub, speculators_verifier="/models/llama-fp8") == "/models/llama-fp8"
    with caplog.at_level(logging.WARNING):
        assert name(TINY_CONFIG) == dep.target_dir                        # the tiny target: no hub id
    assert "export.speculators_verifier" in caplog.text
