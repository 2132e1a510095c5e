"""Plain causal attention over a paged KV cache, in PyTorch (slow, exact)."""
from __future__ import annotations

import torch

from vllm_graft.hooks import AttentionLayer, AttentionMethod, PagedBatch, split_kv_cache


def gather_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int, head_size: int):
    """K, V ``[seq_len, H_kv, D]`` of one sequence from ``kv_cache [N, H_kv, B, 2D]``."""
    k_cache, v_cache = split_kv_cache(kv_cache)  # [N, H_kv, B, D] each
    ids = block_ids.long()

    def flat(cache: torch.Tensor) -> torch.Tensor:
        return cache[ids].permute(0, 2, 1, 3).reshape(-1, cache.shape[1], cache.shape[3])[:seq_len]

    return flat(k_cache), flat(v_cache)


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, batch: PagedBatch,
                    layer: AttentionLayer) -> torch.Tensor:
    out = torch.empty_like(query)
    group = layer.num_heads // layer.num_kv_heads
    block = kv_cache.shape[2]
    for i in range(batch.seq_lens.numel()):
        q0, q1 = int(batch.query_start_loc[i]), int(batch.query_start_loc[i + 1])
        n = int(batch.seq_lens[i])
        if q1 == q0:
            continue
        k, v = gather_kv(kv_cache, batch.block_table[i, : -(-n // block)], n, layer.head_size)
        k = k.float().repeat_interleave(group, dim=1)  # [n, H, D]
        v = v.float().repeat_interleave(group, dim=1)
        q = query[q0:q1].float()  # [q, H, D]
        scores = torch.einsum("qhd,khd->hqk", q, k) * layer.scale
        q_pos = torch.arange(n - (q1 - q0), n).unsqueeze(1)  # absolute positions of the queries
        mask = torch.arange(n).unsqueeze(0) > q_pos  # [q, n]: future keys
        scores.masked_fill_(mask, float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(query.dtype)
    return out


class PagedAttention(AttentionMethod):
    def forward(self, query, kv_cache, batch, layer, plan=None):
        return paged_attention(query, kv_cache, batch, layer)
