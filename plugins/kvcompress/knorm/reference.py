"""K-norm at block granularity (arXiv:2406.11430): blocks scored by minus their keys' mean L2
norm, read from the cache each step (:meth:`KNorm.block_scores`); over budget the top ones stay
(the cache scorer under the keep policy, ``hooks.contracts.kvpolicy``)."""

from __future__ import annotations

from vllm_graft.hooks import CacheScores

from .._shared.keys import key_norm_scores


class KNorm(CacheScores):
    def block_scores(self, kv_cache, batch, layer):
        return key_norm_scores(kv_cache, batch, layer)
