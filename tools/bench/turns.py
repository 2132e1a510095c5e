"""``vllm-graft bench --interleave step``: two arms' engines taking turns step by step.

Alternating whole runs leaves each run to whatever the machine does during it: on a 2-core VM
an A/A's paired run ratios scatter by 6-8% (sd), and 4x longer runs scattered no less, so the
machine's speed drifts over seconds, as long as a run. Here both arms run the same round at
once and hand a baton to each other after every engine step: one engine runs at a time, each
arm's clock counts only its own turns, and a drift slower than a step reaches both arms alike.

The baton is a pair of semaphores, one per side; a side waits on its own and releases the
other's. A side that has finished its round says so while it holds the baton, and from then on
the other runs alone without waiting. The parent resets the flags and hands the first turn
before each round, once both sides have finished the last (no release is left over: checked by
the unit test). No vLLM here: the arms' step loop (:func:`.arm._generate`) calls it."""

from __future__ import annotations

import copy
import time
from typing import Any


class Turns:
    """The baton of two arm processes. Made in the parent (``multiprocessing`` context ``ctx``,
    before the arms start), then :meth:`side` gives each arm its own view, passed to its
    process as it is spawned."""

    def __init__(self, ctx: Any) -> None:
        self._go = (ctx.Semaphore(0), ctx.Semaphore(0))
        self._done = ctx.RawArray("b", 2)  # per side: its round is over
        self.me = -1  # the parent's view: no side

    def side(self, me: int) -> Turns:
        if me not in (0, 1):
            raise ValueError(f"a side is 0 or 1, not {me!r}")
        view = copy.copy(self)
        view.me = me
        return view

    # ------------------------------------------------------------------ the parent
    def start_round(self, first: int) -> None:
        """Before a round, both sides idle: neither has finished it; ``first`` takes the first turn."""
        self._done[0] = self._done[1] = 0
        self._go[first].release()

    # ------------------------------------------------------------------ an arm
    # ``alone``: the other side's round was over when this side last held the baton. It is read
    # only then, since a side that finishes releases the other's semaphore once more: a waiting
    # side that read the flag instead of taking that release would leave it over for the next round.
    alone = False

    def take(self) -> float:
        """Wait for this side's turn (none once the other side's round is over); the seconds waited."""
        if self.alone:
            return 0.0
        t = time.perf_counter()
        self._go[self.me].acquire()
        self.alone = bool(self._done[1 - self.me])
        return time.perf_counter() - t

    def give(self) -> None:
        """End this side's turn: the other side's next."""
        if not self.alone:
            self._go[1 - self.me].release()

    def finish_round(self) -> None:
        """This side's round is over: said while holding the baton, which goes to the other side
        for the rest of its round."""
        self.take()
        self._done[self.me] = 1
        self.give()
        self.alone = False  # the next round starts with both sides in it
