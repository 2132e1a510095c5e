"""K-norm at block granularity (arXiv:2406.11430): blocks scored by minus their keys' mean L2
norm, read from the cache each step (:meth:`KNorm.block_scores`); over budget the top ones stay
(the cache scorer under the keep policy, ``hooks.contracts.kvpolicy``)."""

from __future__ import annotations

import torch

from ....hooks import AttentionLayer, CacheScores, PagedBatch

from .._shared.keys import batch_keys, per_block


def key_norm_scores(kv_cache: torch.Tensor, batch: PagedBatch, layer: AttentionLayer) -> torch.Tensor:
    """``[S, W]``: minus the mean L2 norm of each block's keys (over its tokens and KV heads):
    the higher, the lower the keys' norm, which Devoto et al. 2024 find attention favours."""
    keys, valid = batch_keys(kv_cache, batch, layer)
    return per_block(-keys.norm(dim=-1).mean(dim=2), valid)


class KNorm(CacheScores):
    def block_scores(self, kv_cache, batch, layer):
        return key_norm_scores(kv_cache, batch, layer)
