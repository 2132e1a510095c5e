"""H2O at block granularity (Zhang et al. 2023, arXiv:2306.14048): keep sink blocks, the
recent window and the "heavy hitter" blocks with the most accumulated attention, at most
``budget_blocks`` in all. The technique is its score, the attention mass each block has received
from every query since it was written (``view.scores``, summed over the steps); the keep policy
(``hooks.contracts.kvpolicy``) keeps the best within the budget.

The accumulated attention comes from the worker: a scored compressor that implements no
``attend`` gets the shared attention with per-block mass (``kvcompress/_shared``: the exact
reference, or the Triton decode kernel with ``kernel: triton``).
"""

from __future__ import annotations

from typing import Sequence

from ....hooks import BlockView, PolicyCompressor


class H2O(PolicyCompressor):
    needs_scores = True

    def score(self, view: BlockView) -> Sequence[float] | None:
        if view.scores is None or self.params.score == "sum":
            return view.scores
        # 'mean': per query that could attend to the block (from its first token on)
        return [s / max(1, view.num_tokens - i * view.block_size) for i, s in enumerate(view.scores)]
