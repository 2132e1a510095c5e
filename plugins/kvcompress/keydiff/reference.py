"""KeyDiff at block granularity (arXiv:2504.15364): blocks scored by minus their keys' mean
cosine similarity to the sequence's anchor key, read from the cache each step
(:meth:`KeyDiff.block_scores`); over budget the top (most distinct) ones stay (the cache scorer
under the keep policy, ``hooks.contracts.kvpolicy``)."""

from __future__ import annotations

from vllm_graft.hooks import CacheScores

from .._shared.keys import key_diff_scores


class KeyDiff(CacheScores):
    def block_scores(self, kv_cache, batch, layer):
        return key_diff_scores(kv_cache, batch, layer)
