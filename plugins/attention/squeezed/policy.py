"""Budgets and the head map of the `squeezed` sparse decode attention (pure Python).

A decode token with ``n`` tokens of context attends to ``ceil(budget * n)`` tokens per KV head,
in whole chunks of ``chunk`` tokens: the *forced* chunks (the first ``sink_tokens``, the last
``recent_tokens``, its own token included) and, in ``centroid`` mode, the best-scoring other
chunks up to the budget; in ``window`` mode (the sink + window baseline) the window simply
grows to fill the budget.

The head map (written by ``vllm-graft calibrate razor``) marks each (layer, KV head) as a
retrieval head (full attention) or a streaming head (sinks + recent window only).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HEAD_MAP_FORMAT = "vllm-graft-razor-head-map/1"


@dataclass(frozen=True)
class Budget:
    num_chunks: int  # chunks of context (the last may be partial)
    sink: tuple[int, ...]  # forced chunks at the start
    recent: tuple[int, ...]  # forced chunks at the end
    extra: int  # further chunks to choose (by score, or by growing the window)

    @property
    def full(self) -> bool:
        return len(self.sink) + len(self.recent) + self.extra >= self.num_chunks

    @property
    def chosen(self) -> int:
        """Chunks one KV head attends to."""
        return self.num_chunks if self.full else len(self.sink) + len(self.recent) + self.extra

    def attended(self, n: int, chunk: int) -> int:
        """Tokens one KV head attends to out of ``n`` (chunks of ``chunk``): the chosen chunks,
        every one whole but the last chunk of the context, which the window always holds."""
        return n if self.full else (self.chosen - 1) * chunk + n - (self.num_chunks - 1) * chunk


def budget(n: int, chunk: int, fraction: float, sink_tokens: int, recent_tokens: int) -> Budget:
    """The chunk budget of a decode token with ``n`` context tokens."""
    if n < 1:
        raise ValueError(f"a decode token has at least one token of context (got {n})")
    c = -(-n // chunk)
    total = max(1, -(-math.ceil(fraction * n) // chunk))
    recent_start = max(0, (n - max(recent_tokens, 1)) // chunk)
    recent = tuple(range(recent_start, c))
    sink = tuple(i for i in range(min(-(-sink_tokens // chunk), c)) if i < recent_start)
    extra = max(0, min(total - len(sink) - len(recent), c - len(sink) - len(recent)))
    return Budget(c, sink, recent, extra)


def window_chunks(b: Budget) -> list[int]:
    """Sink + window baseline: the forced chunks and the ``extra`` chunks just before the window."""
    start = b.recent[0] if b.recent else b.num_chunks
    grown = list(range(max(len(b.sink), start - b.extra), start))
    return sorted(set(b.sink) | set(grown) | set(b.recent))


def load_head_map(path: str | Path) -> list[list[bool]]:
    """``retrieval[layer][kv_head]`` from a head-map file; clear errors for a bad file."""
    p = Path(path)
    try:
        data: Any = json.loads(p.read_text())
    except OSError as e:
        raise ValueError(
            f"head map {str(p)!r} cannot be read ({e.strerror}); write one with `vllm-graft calibrate razor --out FILE`"
        ) from None
    except json.JSONDecodeError as e:
        raise ValueError(f"head map {str(p)!r} is not JSON: {e}") from None
    if not isinstance(data, dict) or data.get("format") != HEAD_MAP_FORMAT:
        raise ValueError(f"head map {str(p)!r}: not a {HEAD_MAP_FORMAT} file (written by `vllm-graft calibrate razor`)")
    heads = data.get("retrieval")
    if not (
        isinstance(heads, list)
        and heads
        and all(isinstance(r, list) and r and all(isinstance(x, bool) for x in r) for r in heads)
    ):
        raise ValueError(
            f"head map {str(p)!r}: 'retrieval' must be a list (per layer) of lists (per KV head) of booleans"
        )
    return heads
