"""What several test modules share. Test modules import from here (and from conftest.py), never from each other
(tests/test_architecture.py checks it): the tree under tests/ mirrors the code (docs/architecture.md)."""
from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
REPO = TESTS.parent
DATA = TESTS / "data"   # upstream extractions the tests compare against (each folder's README names its source)
