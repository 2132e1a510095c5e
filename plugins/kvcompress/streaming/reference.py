"""StreamingLLM at block granularity (see ``__init__``): the attention sinks and the recent window.
The technique is its score, recency; the keep policy (``hooks.contracts.kvpolicy``) keeps the
sink blocks, the block being written and the newest others, ``budget_blocks`` in all."""

from __future__ import annotations

from typing import Sequence

from ....hooks import BlockView, PolicyCompressor


class Streaming(PolicyCompressor):
    """Newer blocks first; no attention needed, so the scheduler and the worker decide alike."""

    def score(self, view: BlockView) -> Sequence[float]:
        return [float(i) for i in range(view.num_blocks)]
