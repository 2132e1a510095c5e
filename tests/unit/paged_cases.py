"""A random paged batch, as the attention methods' and compressors' tests build it."""
from __future__ import annotations

import torch

from vllm_graft.hooks import AttentionLayer, PagedBatch


def paged(seqs, h, hkv, d, bs, dtype=torch.float32, seed=0, index=-1):
    """``seqs``: (tokens in the cache, new tokens) per sequence. Each sequence's blocks lie at
    random places of a pool two blocks larger than they need, the rest of its table row points
    at the pool's last block; the blocked cache and the queries are random (``seed``), in
    ``dtype``. Returns (q, kv, batch, layer)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // bs) for n, _ in seqs]
    nb = sum(need) + 2
    perm = torch.randperm(nb, generator=g).tolist()
    table = torch.zeros(len(seqs), max(need) + 1, dtype=torch.int32)
    at = 0
    for i, k in enumerate(need):
        table[i, :k] = torch.tensor(perm[at:at + k])
        table[i, k:] = perm[-1]
        at += k
    qsl = [0]
    for _, q in seqs:
        qsl.append(qsl[-1] + q)
    batch = PagedBatch(torch.tensor(qsl, dtype=torch.int32), torch.tensor([n for n, _ in seqs], dtype=torch.int32), table)
    kv = torch.randn(nb, hkv, bs, 2 * d, generator=g).to(dtype)
    q = torch.randn(qsl[-1], h, d, generator=g).to(dtype)
    return q, kv, batch, AttentionLayer(h, hkv, d, d ** -0.5, bs, index=index)
