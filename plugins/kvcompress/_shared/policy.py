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
