"""What several test modules share. Test modules import from here (and from conftest.py), never from each other
(tests/unit/test_architecture.py checks it): the tree under tests/ mirrors the code (docs/architecture.md)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import NoReturn

import pytest

TESTS = Path(__file__).resolve().parent.parent
REPO = TESTS.parent
TINY_CONFIG = REPO / "configs" / "tiny_fp8_eagle3.yaml"
SUPPORT = TESTS / "support"   # helper scripts a test runs (side environments) and fakes
DATA = TESTS / "data"   # upstream extractions the tests compare against (each folder's README names its source)


def missing(msg: str) -> NoReturn:
    """A side environment (vLLM, speculators, transformers 4.57.1) or engine a test needs is absent: a failure under CI
    (CI=true, where .ci/run creates every environment), a skip with `msg` (how to create it) elsewhere."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(msg)
    pytest.skip(msg)


def real_config(*overrides: str, config: Path = TINY_CONFIG, **sections):
    """The whole validated config the runner holds (`pipeline.config.load_config` on a real config file plus `-o`
    overrides), with `sections` (name -> an instance of that section's model) put in place unvalidated: a test that
    checks one section builds the rest from a real config, never from a partial stand-in."""
    from pipeline.config import load_config

    return load_config(config, list(overrides)).model_copy(update=sections)


def shipped_config_validates(path: Path) -> None:
    """A shipped config loads, and opens with a comment saying what it is and the command that runs it."""
    from pipeline.config import load_config

    text = path.read_text()
    load_config(path)
    assert text.startswith("#"), f"{path.name} must open with a comment saying what it is and how to run it"
    assert "specpipe build configs/" in text.split("\n\n")[0], f"{path.name}: opening comment must give the command"


def triton_model_config(p: Path):
    """A Triton config.pbtxt parsed with Triton's own ModelConfig message (tritonclient's model_config_pb2)."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    return text_format.Parse(p.read_text(), model_config_pb2.ModelConfig())


def script_argv(script: Path, *args: str, **env: str) -> list[str]:
    """The argv a generated `exec ...` shell script would run, expanded by bash itself with `env` set (its `exec` line
    made to print the words instead of running them): what the script does with $HOST, quoting and "$@"."""
    import subprocess

    text = script.read_text()
    assert "\nexec " in text, f"{script} has no exec line"
    text = text.replace("\nexec ", "\nprintf '%s\\0' ", 1)
    r = subprocess.run(["bash", "-c", text, script.name, *args], capture_output=True, check=True,
                       env={**os.environ, **env})
    return r.stdout.decode().split("\0")[:-1]
