"""Ada-KV at block granularity, per KV head (see ``__init__``): SnapKV's window scores per KV head,
and the technique, :func:`adaptive_head_budget`: one budget shared out over the heads by score
under the keep policy's ``allocation: heads`` (``hooks.contracts.kvpolicy``: the blocks each head
keeps, ``keep_heads``, and their union, ``keep``). The per-head masked attention with per-head mass
is the worker's shared one (``kvcompress/_shared``)."""

from __future__ import annotations

from typing import Iterable, Sequence

from ....hooks.contracts.kvpolicy import NEG_INF
from ..snapkv.reference import SnapKV


def adaptive_head_budget(
    head_scores: Sequence[Sequence[float]],
    candidates: Iterable[int],
    slots: int,
    floor: int = 0,
    cap: int | None = None,
) -> list[set[int]]:
    """Ada-KV's budget allocation over KV heads: ``slots`` (head, block) pairs in all, taken by
    score over every head together (a head whose attention is concentrated on few blocks gets
    few, a diffuse head many), after each head's own ``floor`` best blocks (the paper's
    safeguard, so no head is left with nothing). ``head_scores[h][i]``: block i's score for
    head h (``-inf``: the head dropped it; never chosen). ``cap``: at most this many distinct
    blocks over all heads (vLLM frees a block only when no head keeps it, so the distinct blocks
    are the memory held): a pair whose block no head holds yet is skipped once ``cap`` blocks
    are held, a pair of a held block always fits. Ties: the higher score, then the lower head,
    then the older block, so the answer is a function of the scores. Returns each head's blocks."""
    heads = len(head_scores)
    cands = list(candidates)

    def ranked_blocks(h: int) -> list[int]:
        return sorted((i for i in cands if head_scores[h][i] != NEG_INF), key=lambda i: (-float(head_scores[h][i]), i))

    ranked = [ranked_blocks(h) for h in range(heads)]
    key = lambda hi: (-float(head_scores[hi[0]][hi[1]]), hi[0], hi[1])  # noqa: E731
    first = sorted(((h, i) for h in range(heads) for i in ranked[h][: max(0, floor)]), key=key)
    rest = sorted(((h, i) for h in range(heads) for i in ranked[h][max(0, floor) :]), key=key)
    chosen: list[set[int]] = [set() for _ in range(heads)]
    held: set[int] = set()
    taken = 0
    for h, i in first + rest:
        if taken >= slots:
            break
        if i not in held and cap is not None and len(held) >= cap:
            continue
        chosen[h].add(i)
        held.add(i)
        taken += 1
    return chosen


class AdaKV(SnapKV):
    per_head = True
    allocation = "heads"

    def allocate(
        self, unit_scores: Sequence[Sequence[float]], candidates: list[int], budget: int, taken: int
    ) -> list[set[int]]:
        """The budget is a head's average (``budget - taken`` free slots each, ``floor_fraction``
        of them its own), ``held_blocks`` the cap on their union."""
        room = max(0, budget - taken)
        held = self.params.held_blocks
        cap = None if held is None else max(0, held - taken)
        floor = int(self.params.floor_fraction * room)
        return adaptive_head_budget(unit_scores, candidates, len(unit_scores) * room, floor=floor, cap=cap)
