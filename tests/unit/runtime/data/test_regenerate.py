"""runtime/data/regenerate.py's pure parts: where a response falls into a loop, what `cut_loops` keeps, and the
first-turn prompts (`data.regenerate.turns: first`)."""
from __future__ import annotations

import pytest

from runtime.data.regenerate import RegenJob, first_turn, loop_onset, regenerated_rows
from runtime.data.sources import Sample


@pytest.mark.parametrize("ids, onset", [
    ([9, 8] + [1, 2, 3, 4] * 3 + [5], 10),        # 3 copies of 4 tokens from position 2: keep 2 + 2 x 4
    ([9, 8] + [1, 2, 3, 4] * 6, 10),              # the first place it loops, however long the loop runs
    ([7] * 12 + [1], 2),                          # one token 12 times (LOOP_MIN_SPAN): keep two of them
    ([7] * 11 + [1], None),                       # 11 times: under the span (indentation, a short ruler)
    ([1, 2, 3, 4, 5, 6] * 2 + [0], None),         # two copies are not a loop
    (list(range(40)), None),
    ([], None),
])
def test_loop_onset(ids, onset):
    assert loop_onset(ids) == onset


def test_cut_loops_keeps_two_copies_and_counts_what_it_dropped():
    s = Sample("prompt", "p", "d", "f:1")
    loop = [9, 8] + [1, 2, 3, 4] * 5
    jobs, gens = [RegenJob(s, [100, 101], None)] * 2, [loop, [5, 6, 2]]
    rows, st = regenerated_rows(jobs, gens)
    assert rows[0] == ([100, 101] + loop, [0, 0] + [1] * len(loop)) and st == {"looping": 1, "loop_tokens_cut": 0}
    rows, st = regenerated_rows(jobs, gens, cut_loops=True)
    assert rows[0] == ([100, 101, 9, 8, 1, 2, 3, 4, 1, 2, 3, 4], [0, 0] + [1] * 10)
    assert rows[1] == ([100, 101, 5, 6, 2], [0, 0, 1, 1, 1]) and st == {"looping": 1, "loop_tokens_cut": 12}


def test_first_turn_keeps_a_leading_system_message_and_the_first_user_turn():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "More"}]
    s = Sample("messages", msgs, "chat", "f:3", chat=True)
    t = first_turn(s)
    assert t.content == msgs[:2] and t.origin == "f:3" and t.key != s.key   # another prompt: another resume key
    assert first_turn(Sample("messages", msgs[:2], "chat", "f:4")).content == msgs[:2]
    p = Sample("prompt", "Hi", "chat", "f:5", chat=True)
    assert first_turn(p) is p
