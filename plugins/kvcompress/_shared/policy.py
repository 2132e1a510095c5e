"""Pure-Python block planners shared by the eviction compressors (streaming, h2o, snapkv; no tensors)."""

from __future__ import annotations

from typing import Iterable, Sequence


def sink_window(num_blocks: int, sink: int, window: int) -> set[int]:
    """The first ``sink`` and the last ``window`` of ``num_blocks`` blocks."""
    return set(range(min(sink, num_blocks))) | set(range(max(0, num_blocks - window), num_blocks))


def with_pinned(mine: Iterable[int], pinned: Iterable[int]) -> list[int]:
    return sorted(set(mine) | set(pinned))


def top_blocks(scores: Sequence[float], candidates: Iterable[int], k: int) -> set[int]:
    """The ``k`` candidates with the highest score (ties: the older block first, so the
    answer is a deterministic function of the scores)."""
    if k <= 0:
        return set()
    ranked = sorted(candidates, key=lambda i: (-float(scores[i]), i))
    return set(ranked[:k])


def keep_top(view, scores: Sequence[float] | None, budget: int, sink: int) -> list[int]:
    """Over ``budget`` blocks, the ``budget`` ones with the highest ``scores`` (the first
    ``sink`` and the block being written always among them, blocks dropped earlier, ``-inf``,
    never), plus the pinned ones; within budget, without scores or mid-prefill, every block.
    The policy of the compressors that rank by one score per block each step (tova, knorm,
    keydiff); ``view`` is the step's ``BlockView``."""
    n = view.num_blocks
    if n <= budget or scores is None or view.num_tokens < view.num_prompt_tokens:
        return list(range(n))
    fixed = set(range(min(sink, n))) | {n - 1}
    live = [i for i in range(n) if i not in fixed and scores[i] != float("-inf")]
    return with_pinned(fixed | top_blocks(scores, live, budget - len(fixed)), view.pinned)


def adaptive_head_budget(
    head_scores: Sequence[Sequence[float]],
    candidates: Iterable[int],
    slots: int,
    floor: int = 0,
    cap: int | None = None,
) -> list[set[int]]:
    """AdaKV's budget allocation over KV heads: ``slots`` (head, block) pairs in all, taken by
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
        return sorted(
            (i for i in cands if head_scores[h][i] != float("-inf")), key=lambda i: (-float(head_scores[h][i]), i)
        )

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
