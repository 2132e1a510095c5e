"""KeyDiff at block granularity (arXiv:2504.15364): blocks scored by minus their keys' mean
cosine similarity to the sequence's anchor key, read from the cache each step
(:meth:`KeyDiff.block_scores`); over budget the top (most distinct) ones stay (the cache scorer
under the keep policy, ``hooks.contracts.kvpolicy``)."""

from __future__ import annotations

import torch

from ....hooks import AttentionLayer, CacheScores, PagedBatch

from .._shared.keys import batch_keys, per_block


def key_diff_scores(kv_cache: torch.Tensor, batch: PagedBatch, layer: AttentionLayer) -> torch.Tensor:
    """``[S, W]``: minus the mean cosine similarity of each block's keys to the sequence's
    anchor key (per KV head, the normalised mean of the sequence's normalised keys), averaged
    over KV heads: the higher, the more the block's keys differ from the rest (KeyDiff, Park
    et al. 2025)."""
    keys, valid = batch_keys(kv_cache, batch, layer)
    unit = torch.nn.functional.normalize(keys, dim=-1)  # [S, W, H, B, D]
    m = valid[:, :, None, :, None].to(unit.dtype)
    anchor = torch.nn.functional.normalize((unit * m).sum(dim=(1, 3)), dim=-1)  # [S, H, D]
    cos = (unit * anchor[:, None, :, None, :]).sum(-1)  # [S, W, H, B]
    return per_block(-cos.mean(dim=2), valid)


class KeyDiff(CacheScores):
    def block_scores(self, kv_cache, batch, layer):
        return key_diff_scores(kv_cache, batch, layer)
