"""pipeline/commands/table.py: the tables `specpipe build` and `specpipe status` print without importing rich."""
from __future__ import annotations

import io
import re
from types import SimpleNamespace

import pytest

from pipeline.commands.build import print_outcomes
from pipeline.commands.table import render, use_color

HEADERS = ["stage", "action", "reason", "time"]
ROWS = [["target", "ran", "no artifact", "3.5s"],
        ["data", "skip", "params changed: data.max_samples, data.seed, data.regenerate.mode, data.sources.0.path", ""],
        ["train_draft", "blocked", "upstream data failed", ""]]


def _rich(width: int) -> list[str]:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="specpipe build: /tmp/w")
    for h in HEADERS:
        t.add_column(h)
    for r in ROWS:
        t.add_row(*r)
    out = io.StringIO()
    Console(file=out, width=width, emoji=False).print(t)
    return [line.rstrip() for line in out.getvalue().splitlines()]


@pytest.mark.parametrize("width", [160, 60])
def test_the_table_reads_as_richs_did(width):
    """Same text as the rich table the commands printed before (rich 14's HEAVY_HEAD default), wrapped or not."""
    ours = [line.rstrip() for line in render("specpipe build: /tmp/w", HEADERS, ROWS, width=width, wrap=2).splitlines()]
    assert ours == _rich(width)
    body = ours[1:]
    assert len({len(line) for line in body}) == 1 and len(body[0]) <= width      # aligned, within the width
    assert (width == 60) == (len(body) > 7)                                        # 60 columns wrap the reason


def test_styles_only_on_a_terminal_and_as_rich_decides(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    for var in ("NO_COLOR", "FORCE_COLOR", "TERM"):
        monkeypatch.delenv(var, raising=False)
    assert use_color(Tty()) and not use_color(io.StringIO())
    monkeypatch.setenv("TERM", "dumb")
    assert not use_color(Tty())
    monkeypatch.setenv("FORCE_COLOR", "1")
    assert use_color(io.StringIO())
    monkeypatch.setenv("NO_COLOR", "1")
    assert not use_color(Tty())

    styled = render("t", HEADERS, ROWS, width=160, wrap=2, styles=[["", "green", "", ""]] * 3, color=True)
    assert re.search(r"\x1b\[32mran +\x1b\[0m", styled) and "\x1b[1mstage" in styled and "\x1b[3mt\x1b[0m" in styled
    plain = re.sub(r"\x1b\[[0-9;]*m", "", styled)
    assert plain == render("t", HEADERS, ROWS, width=160, wrap=2)                  # styles add codes, nothing else


def test_build_outcomes_table_shows_each_stage_and_times_only_what_ran():
    outcomes = [SimpleNamespace(name="target", action="ran", reason="no artifact", wall_s=3.46),
                SimpleNamespace(name="data", action="failed", reason="params changed: data.seed", wall_s=12.0),
                SimpleNamespace(name="quantize", action="skip", reason="up to date", wall_s=0.2)]
    out = io.StringIO()
    print_outcomes(outcomes, SimpleNamespace(root="/tmp/w"), stream=out)
    lines = out.getvalue().splitlines()
    assert lines[0].strip() == "specpipe build: /tmp/w" and "\x1b" not in out.getvalue()
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in lines if line.startswith("│")]
    assert cells == [["target", "ran", "no artifact", "3.5s"], ["data", "failed", "params changed: data.seed", "12.0s"],
                     ["quantize", "skip", "up to date", ""]]
