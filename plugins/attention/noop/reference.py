"""Plain causal attention over a paged KV cache, in PyTorch (slow, exact)."""
from __future__ import annotations

import torch

from vllm_graft.hooks import AttentionLayer, AttentionMethod, PagedBatch


def gather_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int, head_size: int):
    """K, V ``[seq_len, H_kv, D]`` of one sequence from ``kv_cache [N, H_kv, B, 2D]``."""
    blocks = kv_cache[block_ids.long()]  # [nb, H_kv, B, 2D]
    flat = blocks.permute(0, 2, 1, 3).reshape(-1, kv_cache.shape[1], kv_cache.shape[3])[:seq_len]
    return flat[..., :head_size], flat[..., head_size:]


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
