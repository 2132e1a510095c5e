"""D2O at block granularity: H2O's eviction (its scorer and parameters, ``score: mean`` too) and a
merge of the evicted tokens into their most similar kept tokens (see the package doc)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ..h2o.reference import H2O

if TYPE_CHECKING:
    import torch


def merge_nearest(
    dropped_k: "torch.Tensor",
    dropped_v: "torch.Tensor",
    kept_k: "torch.Tensor",
    kept_v: "torch.Tensor",
    threshold: "torch.Tensor | None",
) -> tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"]:
    """Merge each dropped token (per KV head) into its most similar kept token where the cosine
    similarity of their keys is at least ``threshold[h]``: the kept token's K and V become the
    mean of itself (weight ``e``) and the tokens merged into it (weight ``exp(similarity)``).
    ``dropped_*`` ``[H, E, D]``, ``kept_*`` ``[H, M, D]``, ``threshold`` ``[H]`` (None: this
    eviction's own mean best similarity per head). Returns the new
    kept K and V (the inputs' dtype) and each dropped token's best similarity ``[H, E]``."""
    import torch

    dk, dv = dropped_k.float(), dropped_v.float()
    kk, kv = kept_k.float(), kept_v.float()
    sim = torch.nn.functional.normalize(dk, dim=-1) @ torch.nn.functional.normalize(kk, dim=-1).transpose(1, 2)
    best, nearest = sim.max(dim=-1)  # [H, E]
    if threshold is None:
        threshold = best.mean(dim=-1)
    weight = torch.where(best >= threshold[:, None].to(best.dtype), best.exp(), torch.zeros_like(best))
    denom = torch.full(kk.shape[:2], math.e, dtype=kk.dtype, device=kk.device).scatter_add_(1, nearest, weight)
    at = nearest[..., None].expand_as(dk)
    new_k = (kk * math.e).scatter_add_(1, at, dk * weight[..., None]) / denom[..., None]
    new_v = (kv * math.e).scatter_add_(1, at, dv * weight[..., None]) / denom[..., None]
    touched = (denom > math.e)[..., None]  # a kept token nothing merged into stays bit for bit
    new_k = torch.where(touched, new_k.to(kept_k.dtype), kept_k)
    new_v = torch.where(touched, new_v.to(kept_v.dtype), kept_v)
    return new_k, new_v, best


class D2O(H2O):
    merges = True

    def merge(self, dropped_k, dropped_v, kept_k, kept_v, state=None):
        import torch

        H = kept_k.shape[0]
        if dropped_k.shape[1] == 0 or kept_k.shape[1] == 0:
            return kept_k, kept_v, state
        if self.params.threshold is not None:
            threshold = torch.full((H,), self.params.threshold, dtype=torch.float32, device=kept_k.device)
        else:  # the running threshold; None at the first eviction: its own mean best similarity
            threshold = state
        new_k, new_v, best = merge_nearest(dropped_k, dropped_v, kept_k, kept_v, threshold)
        mean_best = best.mean(dim=-1)
        ema = self.params.ema
        running = mean_best if state is None else ema * state + (1.0 - ema) * mean_best
        return new_k, new_v, running
