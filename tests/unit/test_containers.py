"""Dockerfiles parse, pin images from the one compatibility table, and the table agrees with the
TensorRT-LLM field lists (no Docker engine here: these are static checks)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from runtime.trtllm import compat

from conftest import REPO

INSTRUCTIONS = {"FROM", "ARG", "ENV", "RUN", "COPY", "ADD", "WORKDIR", "ENTRYPOINT", "CMD", "EXPOSE", "LABEL",
                "USER", "VOLUME", "HEALTHCHECK", "SHELL", "STOPSIGNAL", "ONBUILD"}
SHARED_SCHEMAS = REPO / "tests" / "data" / "trtllm_reference"   # upstream extractions, see its README


def parse_dockerfile(path: Path) -> list[tuple[str, str]]:
    """(instruction, arguments) with line continuations joined; raises on an unknown instruction."""
    out, buf = [], ""
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        buf += line.rstrip("\\").strip() + " " if line.rstrip().endswith("\\") else line.strip()
        if line.rstrip().endswith("\\"):
            continue
        word, _, rest = buf.partition(" ")
        if word.upper() not in INSTRUCTIONS:
            raise ValueError(f"{path.name}:{n}: unknown instruction {word!r}")
        out.append((word.upper(), rest.strip()))
        buf = ""
    assert not buf, f"{path.name}: dangling line continuation"
    return out


def base_image(path: Path) -> str:
    ins = parse_dockerfile(path)
    args = {}
    for word, rest in ins:
        if word == "ARG" and "=" in rest:
            k, v = rest.split("=", 1)
            args[k] = v
        if word == "FROM":
            return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], rest.split()[0])
    raise AssertionError(f"{path.name} has no FROM")


@pytest.mark.parametrize("name", ["pipeline.Dockerfile", "serve.Dockerfile"])
def test_dockerfiles_parse_and_copy_what_exists(name):
    ins = parse_dockerfile(REPO / "containers" / name)
    assert ins[0][0] in ("ARG", "FROM")
    for word, rest in ins:
        if word == "COPY":
            *srcs, _dst = rest.split()
            for s in srcs:
                assert (REPO / s).exists(), f"{name}: COPY source {s} missing"
        if word == "ENTRYPOINT":
            json.loads(rest)   # exec form


def test_pipeline_image_is_a_trtllm_release_in_the_table():
    img = base_image(REPO / "containers" / "pipeline.Dockerfile")
    c = next((c for c in compat.CONTAINERS if c.image == img), None)
    assert c is not None and c.kind == "trtllm", img
    assert compat.normalize_version(c.trtllm_version) == compat.DEFAULT_TRTLLM_VERSION
    # the build-arg documented for DFlash is in the table too, and serves DFlash
    text = (REPO / "containers" / "pipeline.Dockerfile").read_text()
    for alt in re.findall(r"BASE_IMAGE=(\S+)", text):
        ca = next((c for c in compat.CONTAINERS if c.image == alt), None)
        assert ca is not None, alt
    dflash = [c for c in compat.CONTAINERS if c.kind == "trtllm" and compat.algorithm_problem(c.trtllm_version, "dflash") is None]
    assert any(c.image in text for c in dflash), "the Dockerfile should name an image that serves DFlash"


def test_serve_image_pins_the_shipped_triton_image():
    img = base_image(REPO / "containers" / "serve.Dockerfile")
    assert img == compat.SHIPPED_TRITON_IMAGE
    c = next(c for c in compat.CONTAINERS if c.image == img)
    assert c.kind == "triton" and c.trtllm_version == compat.DEFAULT_TRTLLM_VERSION
    assert "/opt/specpipe/triton/launch.sh" in (REPO / "containers" / "serve.Dockerfile").read_text()


def test_dflash_on_a_12_image_is_refused_naming_one_that_works():
    msg = compat.algorithm_problem("1.2.1", "dflash")
    assert msg and "1.3" in msg
    assert compat.algorithm_problem("1.3.0rc27", "dflash") is None
    assert compat.algorithm_problem("1.2.1", "eagle3") is None


@pytest.mark.parametrize("line", sorted(compat.RELEASES))
def test_table_agrees_with_the_schemas(line):
    rel = compat.RELEASES[line]
    packaged = json.loads((REPO / "runtime" / "trtllm" / "schemas" / f"{rel.schema}.json").read_text())
    shared_name = {"1.2": "trtllm-1.2-llmapi.json", "1.3": "trtllm-1.3-specdec.json"}[line]
    sources = [packaged, json.loads((SHARED_SCHEMAS / shared_name).read_text())]
    for schema in sources:
        types = schema["decoding_types"]
        for algo, dtype in rel.decoding_types.items():
            assert dtype in types, f"{line}: decoding_type {dtype} for {algo} not in the schema"
        classes = schema["classes"]
        assert ("DFlashDecodingConfig" in classes) == ("dflash" in rel.algorithms)
        base = classes["DecodingBaseConfig"]
        fields = base.get("fields", base)
        names = set(fields) if isinstance(fields, dict) else {f["name"] if isinstance(f, dict) else f for f in fields}
        assert rel.acceptance_window_key in names and rel.acceptance_threshold_key in names, (line, sorted(names)[:40])
