"""The box-drawn tables `specpipe build` and `specpipe status` print, without rich.

`specpipe build` prints its table after every build, the no-op rebuild included, and importing rich's console for
it cost ~9 % of a no-op rebuild's instructions (docs/benchmarks.md "No-op rebuild"). The look is rich's HEAVY_HEAD
table as these commands printed it before: a centred title, a bold header, cells padded by one space, the widest
wrappable column wrapped to keep the table within `width` columns. ANSI styles only where rich would use them: on a
terminal, not under NO_COLOR or TERM=dumb, always under FORCE_COLOR.
"""
from __future__ import annotations

import os
import textwrap
from typing import TextIO

_SGR = {"bold": "1", "dim": "2", "italic": "3", "red": "31", "green": "32", "yellow": "33"}
_MIN_WRAPPED = 12        # a wrapped column keeps at least this many characters a line


def use_color(stream: TextIO) -> bool:
    """rich's rule (console.py): NO_COLOR (non-empty) turns styles off, FORCE_COLOR (non-empty) on, a dumb terminal
    and anything that is not a terminal off."""
    if os.environ.get("NO_COLOR", ""):
        return False
    if os.environ.get("FORCE_COLOR", ""):
        return True
    if os.environ.get("TERM", "").lower() in ("dumb", "unknown"):
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def _styled(text: str, style: str, color: bool) -> str:
    codes = ";".join(_SGR[s] for s in style.split() if s in _SGR)
    return f"\x1b[{codes}m{text}\x1b[0m" if color and codes and text.strip() else text


def render(title: str, headers: list[str], rows: list[list[str]], *, width: int, wrap: int,
           styles: list[list[str]] | None = None, color: bool = False) -> str:
    """The table as text. `wrap`: the column that gives way when the table is wider than `width`; `styles[r][c]`: a
    style for a cell ("green", "dim", "bold red", ...), applied after padding so the columns stay aligned."""
    widths = [max([len(h)] + [len(r[c]) for r in rows]) for c, h in enumerate(headers)]
    excess = sum(widths) + 3 * len(widths) + 1 - width
    if excess > 0:
        widths[wrap] = max(_MIN_WRAPPED, widths[wrap] - excess)
    total = sum(widths) + 3 * len(widths) + 1

    def rule(left: str, mid: str, right: str, fill: str) -> str:
        return left + mid.join(fill * (w + 2) for w in widths) + right

    lines = [" " * max(0, (total - len(title)) // 2) + _styled(title, "italic", color)]
    lines.append(rule("┏", "┳", "┓", "━"))
    head = [f" {_styled(h.ljust(w), 'bold', color)} " for h, w in zip(headers, widths, strict=True)]
    lines.append("┃" + "┃".join(head) + "┃")
    lines.append(rule("┡", "╇", "┩", "━"))
    for r, row in enumerate(rows):
        cells = [textwrap.wrap(cell, w, break_on_hyphens=False) or [""] if len(cell) > w else [cell]
                 for cell, w in zip(row, widths, strict=True)]
        for i in range(max(len(c) for c in cells)):
            parts = []
            for c, (cell, w) in enumerate(zip(cells, widths, strict=True)):
                text = (cell[i] if i < len(cell) else "").ljust(w)
                parts.append(f" {_styled(text, styles[r][c] if styles else '', color)} ")
            lines.append("│" + "│".join(parts) + "│")
    lines.append(rule("└", "┴", "┘", "─"))
    return "\n".join(lines if title else lines[1:]) + "\n"
