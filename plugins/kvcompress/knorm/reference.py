"""K-norm at block granularity (arXiv:2406.11430): blocks scored by minus their keys' mean L2
norm, read from the cache each step (:meth:`KNorm.block_scores`); over budget the top ones stay."""

from __future__ import annotations

from vllm_graft.hooks import BlockView, KVCompressor

from .._shared.keys import key_norm_scores
from .._shared.policy import keep_top


class KNorm(KVCompressor):
    needs_scores = True
    kv_layouts = ("blocked", "packed")  # block_scores reads through layer.kv_layout.split

    def block_scores(self, kv_cache, batch, layer):
        return key_norm_scores(kv_cache, batch, layer)

    def keep(self, view: BlockView) -> list[int]:
        # this step's scores: the keys' norms now (summed over layers), not summed over steps
        return keep_top(view, view.step_scores, self.params.budget_blocks, self.params.sink_blocks)

    def describe(self):
        return self.params.model_dump()
