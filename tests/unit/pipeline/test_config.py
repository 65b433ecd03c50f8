"""Config errors name the field as the user wrote it, exit 2, and never show a traceback."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pipeline.config import load_config
from pipeline.errors import ConfigError

from conftest import REPO, run_cli
from support import shipped_config_validates
from support.synthetic import needs_prepared_inputs

BASE = {"target": {"bootstrap": "tiny"}}


def _write(tmp_path: Path, doc, name: str = "c.yaml") -> Path:
    p = tmp_path / name
    p.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    return p


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


BAD = [
    # (extra config, expected dotted path, a word the message must contain)
    ({"targett": {}}, "targett", "unknown field"),
    ({"target": {"tiny": {"hiden_size": 8}}}, "target.tiny.hiden_size", "unknown field"),
    ({"target": {"tiny": {"steps": "many"}}}, "target.tiny.steps", "integer"),
    ({"target": {"tiny": {"steps": 0}}}, "target.tiny.steps", "greater than"),
    ({"target": {"tiny": {"hidden_size": 100, "num_heads": 3}}}, "target.tiny", "divisible"),
    ({"target": {"model": "/some/where"}}, "target", "exactly one"),
    ({"hardware": {"gpu": "h300"}}, "hardware.gpu", "known: "),
    ({"run": {"device": "tpu"}}, "run.device", "expected"),
    ({"data": {"sources": [{"kind": "parquet", "path": "x"}]}}, "data.sources.0.kind", "value"),
    ({"data": {"sources": [{"kind": "jsonl"}]}}, "data.sources.0.path", "required"),
    ({"data": {"sources": [{"kind": "jsonl", "path": "x.jsonl", "colour": 1}]}}, "data.sources.0.colour", "unknown field"),
    ({"data": {"sources": [{"kind": "jsonl", "path": "/nonexistent/x.jsonl"}]}}, "data.sources.0.path", "not found"),
    ({"data": {"eval_domains": {"a b": {"kind": "bootstrap"}}}}, "data.eval_domains", "domain name"),
    ({"data": {"eval_domains": {"code": {"kind": "bootstrap", "style": "poetry"}}}}, "data.eval_domains.code.style", "expected"),
    ({"data": {"regenerate": {"mode": "beam"}}}, "data.regenerate.mode", "expected"),
]


@pytest.mark.parametrize("extra,path,word", BAD, ids=[b[1] for b in BAD])
def test_bad_config_names_the_dotted_path(tmp_path, extra, path, word):
    doc = _merge(BASE, extra)
    if "model" in doc.get("target", {}):
        doc["target"] = {"model": "/some/where", "bootstrap": "tiny"}
    p = _write(tmp_path, doc)
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    paths = [pp for pp, _ in ei.value.problems]
    assert path in paths, ei.value.lines()
    msg = dict(ei.value.problems)[path]
    assert word in msg, msg


def test_every_problem_is_reported_at_once(tmp_path):
    p = _write(tmp_path, _merge(BASE, {"target": {"tiny": {"steps": "x", "lr": "y"}}, "bogus": 1}))
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    assert {pp for pp, _ in ei.value.problems} >= {"target.tiny.steps", "target.tiny.lr", "bogus"}


def test_union_tags_never_appear_in_paths(tmp_path):
    p = _write(tmp_path, _merge(BASE, {"data": {"sources": [{"kind": "hf", "name": "x", "columns": {"weird": "c"}}]}}))
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    for pp, _ in ei.value.problems:
        assert "hf" not in pp.split("."), pp
        assert pp.startswith("data.sources.0.columns"), pp


def test_line_numbers_point_into_the_file(tmp_path):
    p = _write(tmp_path, "target:\n  bootstrap: tiny\n  tiny:\n    steps: lots\n")
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    assert "line 4" in dict(ei.value.problems)["target.tiny.steps"]


@pytest.mark.parametrize("text,word", [
    ("target:\n  bootstrap: tiny\n   tiny: {}\n", "YAML syntax error"),
    ("target: {bootstrap: tiny}\ntarget: {bootstrap: tiny}\n", "duplicate key 'target'"),
    ("- a\n- b\n", "top level must be a mapping"),
])
def test_yaml_problems(tmp_path, text, word):
    p = _write(tmp_path, text)
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    assert word in ei.value.lines()[0]
    if "syntax" in word:
        assert ":3:" in ei.value.lines()[0]   # file:line:column


def test_the_libyaml_reader_reads_what_the_python_one_reads_and_leaves_it_the_errors(tmp_path):
    """read_yaml parses with libyaml where PyYAML has it and reads a file libyaml refuses again with the pure-Python
    loader, so the data and the messages above are the pure-Python loader's."""
    from pipeline import config as C

    assert C._CLoader.__mro__[1] is getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    for f in sorted((REPO / "configs").glob("*.yaml")):
        text = f.read_text()
        assert C.read_yaml(f)[0] == yaml.load(text, Loader=C._Loader), f.name
    p = _write(tmp_path, "a: 1\na: 2\n")
    with pytest.raises(yaml.constructor.ConstructorError, match="duplicate key 'a'"):
        C._parse(p.read_text(), C._CLoader)    # the refusal that sends the file to the pure-Python loader


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError) as ei:
        load_config(tmp_path / "nope.yaml")
    assert "config file not found" in ei.value.lines()[0]


def test_overrides_are_typed_and_validated(tmp_path):
    p = _write(tmp_path, BASE)
    cfg = load_config(p, ["target.tiny.steps=7", "target.tiny.lr=0.01", "data.regenerate.enabled=true"])
    assert cfg.target.tiny.steps == 7 and cfg.target.tiny.lr == 0.01 and cfg.data.regenerate.enabled is True
    with pytest.raises(ConfigError) as ei:
        load_config(p, ["target.tiny.stepz=7"])
    (path, msg), = ei.value.problems
    assert path == "target.tiny.stepz" and "unknown field" in msg and "(from -o)" in msg and "steps" in msg
    with pytest.raises(ConfigError) as ei:
        load_config(p, ["target.tiny.steps=abc"])
    assert ei.value.problems[0][0] == "target.tiny.steps"
    with pytest.raises(ConfigError) as ei:
        load_config(p, ["target.bootstrap.x=1"])
    assert ei.value.problems[0][0] == "target.bootstrap"
    with pytest.raises(ConfigError):
        load_config(p, ["novalue"])


def test_disabled_input_stage_is_a_config_error(tmp_path):
    p = _write(tmp_path, BASE)
    with pytest.raises(ConfigError) as ei:
        load_config(p, ["target.enabled=false"])
    assert ei.value.problems[0][0] == "target.enabled"
    assert "consumes 'target'" in ei.value.problems[0][1]


@pytest.mark.parametrize("path", [p for p in sorted((REPO / "configs").glob("*.yaml")) if not needs_prepared_inputs(p)],
                         ids=lambda p: p.name)
def test_every_shipped_config_validates(path):
    """The configs that load without the real model's prepared inputs (the others: test_config_real.py)."""
    shipped_config_validates(path)


def test_cli_check_exit_codes_and_no_traceback(tmp_path):
    good = run_cli("check", str(REPO / "configs" / "tiny_fp8_eagle3.yaml"))
    assert good.returncode == 0, good.stderr
    assert "OK" in good.stdout
    bad = _write(tmp_path, _merge(BASE, {"target": {"tiny": {"steps": "x"}}, "bogus": 1}))
    r = run_cli("check", str(bad))
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "target.tiny.steps:" in r.stderr and "bogus:" in r.stderr
    r = run_cli("check", str(tmp_path / "missing.yaml"))
    assert r.returncode == 2 and "not found" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("check", str(bad), "-o", "nonsense")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    r = run_cli("build", str(REPO / "configs" / "tiny_fp8_eagle3.yaml"), "--workdir", str(tmp_path / "w"), "--only",
                "nosuchstage")
    assert r.returncode == 2 and "unknown stage" in r.stderr and "target" in r.stderr
    assert not (tmp_path / "w" / "artifacts").exists()


def test_status_and_report_need_a_workdir_unless_one_run_exists(tmp_path):
    for cmd in ("status", "report"):
        r = run_cli(cmd, cwd=tmp_path)
        assert r.returncode == 2 and "give --workdir" in r.stderr and "Traceback" not in r.stderr
        r = run_cli(cmd, "--workdir", str(tmp_path / "nope"), cwd=tmp_path)
        assert r.returncode == 2 and "no such directory" in r.stderr


@pytest.mark.parametrize("edit, word", [
    ("    export: export_stage.Config = Field(default_factory=export_stage.Config)\n", "declares sections"),   # one missing
    ("    target: target_stage.Config\n", "PipelineConfig.target must be stages.target.Config, required"),
])
def test_the_declared_root_config_must_match_the_registry(tmp_path, monkeypatch, edit, word):
    """stages/config.py declares the whole config file; the registry refuses a declaration that drops a stage's
    section or makes the required `target` optional (here: stages/config.py copied with one line changed)."""
    from pipeline import registry

    src = (REPO / "stages" / "config.py").read_text()
    line = "        " + edit.strip() + "\n"
    assert line in src
    repl = "" if "export" in edit else "        target: target_stage.Config = Field(default_factory=dict)\n"
    mod = f"alt_root_config_{'export' if 'export' in edit else 'target'}"     # one module name per case
    (tmp_path / f"{mod}.py").write_text(src.replace(line, repl))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "ROOT_CONFIG", mod)
    with pytest.raises(RuntimeError, match=word):
        registry.root_config.__wrapped__()
    monkeypatch.setattr(registry, "ROOT_CONFIG", "stages.config")
    assert list(registry.root_config.__wrapped__().model_fields)[3:] == registry.names()
