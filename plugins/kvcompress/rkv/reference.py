"""R-KV at block granularity (see ``__init__``): TOVA's current-query scorer (its queries and
policy) whose block scores combine the attention mass with the keys'
redundancy (:meth:`RKV.block_scores`), cut back to the budget once per ``slack_blocks``."""

from __future__ import annotations

import torch

from ....hooks import AttentionLayer, PagedBatch

from .._shared.keys import observed_rows
from ..keydiff.reference import key_diff_scores
from ..tova.reference import TOVA


class RKV(TOVA):
    kv_layouts = ("blocked", "packed", "cpu_vec")  # block_scores reads through layer.kv_layout.split

    def block_scores(self, kv_cache, batch, layer, observe=None, mass=None):
        return rkv_scores(kv_cache, batch, layer, observe, mass, self.params.importance_weight)


def rkv_scores(
    kv_cache: torch.Tensor,
    batch: PagedBatch,
    layer: AttentionLayer,
    observe: torch.Tensor | None,
    mass: torch.Tensor | None,
    weight: float,
) -> torch.Tensor:
    """``[S, W]``: ``weight x importance - (1 - weight) x redundancy`` per block. Importance: the
    observed queries' attention mass on the block over the mass they spread in all (heads x
    queries), so each sequence's importances sum to 1; zero without mass or observed queries.
    Redundancy: the mean cosine similarity of the block's keys to the sequence's mean key."""
    redundancy = -key_diff_scores(kv_cache, batch, layer)  # [S, W]
    S, W = redundancy.shape
    importance = torch.zeros_like(redundancy)
    if mass is not None and observe is not None:
        _, _, count = observed_rows(observe, batch, S, observe.shape[0])
        m = mass[:S, :W].float()
        importance = m / (count[:, None] * layer.num_heads).clamp(min=1)
    return weight * importance - (1.0 - weight) * redundancy
