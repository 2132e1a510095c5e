"""The baton of ``bench --interleave step`` (tools/bench/turns.py), in two spawned processes as
the arms run it: one side steps at a time, the sides alternate while both have steps left, the
one left runs alone, and no turn is left over from one round to the next."""

import multiprocessing
import time

import pytest

from vllm_graft.tools.bench.turns import Turns


def _side(turns, steps_per_round, out):
    """An arm's loop: per round, its steps each inside a turn, then finish_round; each step's
    (round, side, start, end) on ``out``."""
    for r, steps in enumerate(steps_per_round):
        for _ in range(steps):
            turns.take()
            start = time.perf_counter()
            time.sleep(0.002)  # the engine step
            out.put((r, turns.me, start, time.perf_counter()))
            turns.give()
        turns.finish_round()
        out.put((r, turns.me, "done", None))


def test_two_sides_take_turns_step_by_step_round_after_round():
    ctx = multiprocessing.get_context("spawn")
    turns = Turns(ctx)
    steps = {0: [5, 2, 0, 4], 1: [3, 6, 4, 4]}  # side 0 ends first, then side 1; a side with no steps
    out = ctx.Queue()
    procs = [ctx.Process(target=_side, args=(turns.side(me), steps[me], out)) for me in (0, 1)]
    for p in procs:
        p.start()
    seen = []
    for r in range(4):
        turns.start_round(first=r % 2)  # the parent: who goes first alternates
        done = 0
        while done < 2:
            item = out.get(timeout=60)
            done += item[2] == "done"
            if item[2] != "done":
                seen.append(item)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    for r in range(4):
        got = sorted((s for s in seen if s[0] == r), key=lambda s: s[2])
        assert [s[1] for s in got].count(0) == steps[0][r] and [s[1] for s in got].count(1) == steps[1][r]
        for a, b in zip(got, got[1:]):
            assert a[3] <= b[2], f"round {r}: two steps ran at once"
        both = min(steps[0][r], steps[1][r])
        order = [s[1] for s in got]
        first = r % 2 if steps[r % 2][r] else 1 - r % 2
        assert order[: 2 * both] == [first, 1 - first] * both, f"round {r}: no strict alternation: {order}"
    # nothing left over: a leftover release would let both sides step at once in the next round
    assert not turns._go[0].acquire(block=False) and not turns._go[1].acquire(block=False)


def test_a_side_is_zero_or_one():
    turns = Turns(multiprocessing.get_context("spawn"))
    assert turns.side(1).me == 1 and turns.me == -1
    with pytest.raises(ValueError, match="0 or 1"):
        turns.side(2)
