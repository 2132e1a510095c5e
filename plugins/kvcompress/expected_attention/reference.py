"""Expected Attention at block granularity (see ``__init__``): SnapKV's window scorer
(its observation window and policy) with its scores read from the cache and the window's queries
(:meth:`ExpectedAttention.block_scores`), not from the attention mass."""

from __future__ import annotations

import torch

from ....hooks import AttentionLayer, PagedBatch

from .._shared.keys import batch_keys, observed_rows
from ..snapkv.reference import SnapKV


class ExpectedAttention(SnapKV):
    kv_layouts = ("blocked", "packed", "cpu_vec")  # block_scores reads through layer.kv_layout.split

    def block_scores(self, kv_cache, batch, layer, query=None, observe=None):
        return expected_attention_scores(kv_cache, batch, layer, query, observe, self.params.use_vnorm)


def query_statistics(query: torch.Tensor, observe: torch.Tensor, batch: PagedBatch, num_seqs: int):
    """``(mean [S, H, D], variance [S, H, D], count [S])`` of each sequence's observed queries
    (float32; zero where a sequence observed none), with no host read."""
    q = query.float()
    seq, w, count = observed_rows(observe, batch, num_seqs, q.shape[0])
    total = torch.zeros(num_seqs, *q.shape[1:], device=q.device).index_add_(0, seq, q * w[:, None, None])
    square = torch.zeros_like(total).index_add_(0, seq, q * q * w[:, None, None])
    n = count.clamp(min=1)[:, None, None]
    mean = total / n
    return mean, (square / n - mean * mean).clamp(min=0), count


def expected_attention_scores(
    kv_cache: torch.Tensor,
    batch: PagedBatch,
    layer: AttentionLayer,
    query: torch.Tensor | None,
    observe: torch.Tensor | None,
    use_vnorm: bool = True,
) -> torch.Tensor:
    """``[S, W]``: each block's expected attention from queries drawn from the Gaussian of
    the sequence's observed queries (per query head: mean, diagonal variance), summed over the
    block's tokens and the query heads, each key's weighted by its value's norm
    (``use_vnorm``); zero for a sequence that observed no query this step (or without queries)."""
    keys, valid = batch_keys(kv_cache, batch, layer)  # [S, W, Hkv, B, D], [S, W, B]
    S, W, hkv, B, D = keys.shape
    if query is None or observe is None:
        return torch.zeros(S, W, device=keys.device)
    mean, var, count = query_statistics(query, observe, batch, S)
    G = mean.shape[1] // hkv
    mean, var = mean.view(S, hkv, G, D), var.view(S, hkv, G, D)
    scale = float(layer.scale)
    # E[exp(s q.k)] = exp(s mu.k + s^2 k' diag(var) k / 2): the expected logit, per query head
    logit = scale * torch.einsum("swhbd,shgd->shgwb", keys, mean)
    logit = logit + 0.5 * scale * scale * torch.einsum("swhbd,shgd->shgwb", keys * keys, var)
    logit = logit.masked_fill(~valid[:, None, None, :, :], float("-inf"))
    prob = torch.softmax(logit.reshape(S, hkv, G, W * B), dim=-1).view(S, hkv, G, W, B)
    prob = torch.nan_to_num(prob)  # a sequence with no valid key
    expected = prob.sum(dim=2)  # [S, Hkv, W, B]
    if use_vnorm:
        _, value_cache = layer.kv_layout.split(kv_cache)
        values = value_cache[batch.block_table.long().clamp(min=0)].float()  # [S, W, Hkv, B, D]
        expected = expected * values.norm(dim=-1).permute(0, 2, 1, 3)
    scores = expected.sum(dim=(1, 3))  # [S, W]
    return torch.where(count[:, None] > 0, scores, torch.zeros((), device=scores.device))
