"""H2O at block granularity (Zhang et al. 2023, arXiv:2306.14048): keep sink blocks, the
recent window and the "heavy hitter" blocks with the most accumulated attention, at most
``budget_blocks`` in all.

The accumulated attention comes from the worker: a scored compressor that implements no
``attend`` gets the shared attention with per-block mass (``kvcompress/_shared``: the exact
reference, or the Triton decode kernel with ``kernel: triton``). H2O is its policy alone.
"""

from __future__ import annotations

from vllm_graft.hooks import BlockView, KVCompressor

from .._shared.policy import sink_window, top_blocks, with_pinned


class H2O(KVCompressor):
    needs_scores = True

    def keep(self, view: BlockView) -> list[int]:
        p = self.params
        n = view.num_blocks
        if n <= p.budget_blocks or view.scores is None:
            return list(range(n))  # within budget (or asked without scores): drop nothing
        fixed = sink_window(n, p.sink_blocks, p.recent_blocks)
        scores = view.scores
        if p.score == "mean":  # per query that could attend to the block (from its first token on)
            scores = [s / max(1, view.num_tokens - i * view.block_size) for i, s in enumerate(scores)]
        heavy = top_blocks(
            scores, [i for i in range(n) if i not in fixed and scores[i] != float("-inf")], p.budget_blocks - len(fixed)
        )
        return with_pinned(fixed | heavy, view.pinned)

    def describe(self):
        return self.params.model_dump()
