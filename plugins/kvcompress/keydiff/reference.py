"""KeyDiff at block granularity (arXiv:2504.15364): blocks scored by minus their keys' mean
cosine similarity to the sequence's anchor key, read from the cache each step
(:meth:`KeyDiff.block_scores`); over budget the top (most distinct) ones stay."""

from __future__ import annotations

from vllm_graft.hooks import BlockView, KVCompressor

from .._shared.keys import key_diff_scores
from .._shared.policy import keep_top


class KeyDiff(KVCompressor):
    needs_scores = True
    kv_layouts = ("blocked", "packed")  # block_scores reads through layer.kv_layout.split

    def block_scores(self, kv_cache, batch, layer):
        return key_diff_scores(kv_cache, batch, layer)

    def keep(self, view: BlockView) -> list[int]:
        # this step's scores: similarity to the anchor as it is now, not summed over steps
        return keep_top(view, view.step_scores, self.params.budget_blocks, self.params.sink_blocks)

    def describe(self):
        return self.params.model_dump()
