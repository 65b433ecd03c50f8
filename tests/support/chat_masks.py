"""A two-turn chat and the decoded masked/unmasked tokens of an encoding: what the chat-template mask tests (the tiny
target's template, tests/unit; SmolLM2's and the shipped templates, tests/e2e) compare."""
from __future__ import annotations

CHAT = [
    {"role": "user", "content": "What is 7 times 6?"},
    {"role": "assistant", "content": "7 times 6 is 42."},
    {"role": "user", "content": "And in Python?"},
    {"role": "assistant", "content": "```python\nprint(7 * 6)\n```\nIt prints 42."},
]


def masked_runs(tok, ids, mask) -> list[str]:
    """The masked tokens, decoded, one string per contiguous run."""
    out, cur = [], []
    for t, m in zip(ids, mask, strict=True):
        if m:
            cur.append(t)
        elif cur:
            out.append(tok.decode(cur))
            cur = []
    if cur:
        out.append(tok.decode(cur))
    return out


def unmasked(tok, ids, mask) -> str:
    return tok.decode([t for t, m in zip(ids, mask, strict=True) if not m])
