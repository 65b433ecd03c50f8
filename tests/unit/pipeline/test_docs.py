"""The README stays true: its config reference matches the code, its first commands are the ones CI runs."""
from __future__ import annotations

from pipeline.docs import BEGIN, END, generate

from conftest import REPO


def test_readme_config_reference_is_current():
    text = (REPO / "README.md").read_text()
    block = text[text.index(BEGIN): text.index(END) + len(END)]
    assert block == generate(), "README config reference is stale: run `python -m pipeline.docs --write`"


def test_readme_opens_with_the_two_commands_ci_runs():
    readme = (REPO / "README.md").read_text().split("---")[0]
    ci = (REPO / ".ci" / "run").read_text()
    install = next(line.strip() for line in readme.splitlines() if "pip install" in line)
    test = next(line.strip() for line in readme.splitlines() if "pytest" in line)
    assert "specpipe build configs/tiny_fp8_eagle3.yaml" in install
    assert "pip install torch==2.13.0 && pip install -e '.[serve,test]'" in install
    assert "pip install torch==2.13.0 && pip install -e '.[serve,test]'" in ci
    assert "python -m pytest -q" in test and "python -m pytest -q" in ci
