"""The shipped real-model configs (tests/e2e: they name the real model's inputs, which `bash bench/real_model/prepare.sh`
prepares and their file checks read; skipped, naming it, where they are not prepared, a failure under CI)."""
from __future__ import annotations

import pytest

from support import REPO, shipped_config_validates
from support.synthetic import needs_prepared_inputs


@pytest.mark.parametrize("path", [p for p in sorted((REPO / "configs").glob("*.yaml")) if needs_prepared_inputs(p)],
                         ids=lambda p: p.name)
def test_every_real_model_config_validates(path, real_model):
    shipped_config_validates(path)
