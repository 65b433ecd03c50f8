"""Stage `train_draft` against each shipped config's own budgets (capture layers, draft options, the offline dump's
size), from the config alone: no training (support/budgets.py). The configs that read the real model's prepared
inputs: test_train_draft_real.py."""
from __future__ import annotations

import pytest

from support import REPO
from support.budgets import runs_within_its_own_budgets
from support.synthetic import needs_prepared_inputs


@pytest.mark.parametrize("path", [p for p in sorted((REPO / "configs").glob("*.yaml")) if not needs_prepared_inputs(p)],
                         ids=lambda p: p.name)
def test_shipped_config_runs_within_its_own_budgets(path):
    runs_within_its_own_budgets(path)
