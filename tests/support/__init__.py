"""What several test modules share. Test modules import from here (and from conftest.py), never from each other
(tests/test_architecture.py checks it): the tree under tests/ mirrors the code (docs/architecture.md)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import NoReturn

import pytest

TESTS = Path(__file__).resolve().parent.parent
REPO = TESTS.parent
DATA = TESTS / "data"   # upstream extractions the tests compare against (each folder's README names its source)


def missing(msg: str) -> NoReturn:
    """A side environment (vLLM, speculators, transformers 4.57.1) or engine a test needs is absent: a failure under CI
    (CI=true, where .ci/run creates every environment), a skip with `msg` (how to create it) elsewhere."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(msg)
    pytest.skip(msg)
