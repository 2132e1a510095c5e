"""H2O at block granularity (Zhang et al. 2023, arXiv:2306.14048): keep sink blocks, the
recent window and the "heavy hitter" blocks with the most accumulated attention, at most
``budget_blocks`` in all: the accumulated-mass scorer under the keep policy
(``hooks.contracts.kvpolicy``).

The accumulated attention comes from the worker: a scored compressor that implements no
``attend`` gets the shared attention with per-block mass (``kvcompress/_shared``: the exact
reference, or the Triton decode kernel with ``kernel: triton``). H2O is its scorer alone.
"""

from __future__ import annotations

from typing import Sequence

from vllm_graft.hooks import AccumulatedMass, BlockView


class H2O(AccumulatedMass):
    def score(self, view: BlockView) -> Sequence[float] | None:
        if view.scores is None or self.params.score == "sum":
            return view.scores
        # 'mean': per query that could attend to the block (from its first token on)
        return [s / max(1, view.num_tokens - i * view.block_size) for i, s in enumerate(view.scores)]
