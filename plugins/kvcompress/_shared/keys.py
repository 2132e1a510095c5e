"""What the compressors that read the cache (``KVCompressor.block_scores``: ``knorm``, ``keydiff``,
``rkv``, ``expected-attention``) share, none of them a paper's score: the batch's keys gathered
by block table, a per-token score's mean per block, and which query rows are observed. Exact
PyTorch over the batch's blocks: each layer gathers the keys of every block in the batch's block
table (a copy the size of the batch's keys), on the cache's device, with no host sync."""

from __future__ import annotations

import torch

from ....hooks import AttentionLayer, PagedBatch


def batch_keys(kv_cache: torch.Tensor, batch: PagedBatch, layer: AttentionLayer):
    """``(keys [S, W, H_kv, B, D] float32, valid [S, W, B] bool)``: each sequence's blocks'
    keys by block-table column, and which token slots hold one of its tokens."""
    key_cache, _ = layer.kv_layout.split(kv_cache)  # [N, H_kv, B, D]
    table = batch.block_table.long()
    S, W = table.shape
    B = key_cache.shape[2]
    keys = key_cache[table.clamp(min=0)].float()  # [S, W, H_kv, B, D]
    pos = torch.arange(W * B, device=table.device).view(1, W, B)
    valid = pos < batch.seq_lens.to(table.device).long().view(S, 1, 1)
    return keys, valid


def per_block(token_scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The mean of ``token_scores [S, W, B]`` over each block's valid slots (0 where none)."""
    n = valid.sum(-1)
    total = torch.where(valid, token_scores, torch.zeros((), device=valid.device)).sum(-1)
    return torch.where(n > 0, total / n.clamp(min=1), torch.zeros((), device=valid.device))


def observed_rows(observe: torch.Tensor, batch: PagedBatch, num_seqs: int, num_rows: int):
    """``(sequence [T], weight [T] float32, count [S] float32)``: each query row's sequence (from
    ``query_start_loc``, on the device: no host read), 1.0 where the row is observed (rows past
    the batch's last sequence, padding, weigh 0) and the observed rows per sequence."""
    dev = observe.device
    starts = batch.query_start_loc.to(dev).long()
    rows = torch.arange(num_rows, device=dev)
    seq = torch.bucketize(rows, starts[1 : num_seqs + 1], right=True).clamp(max=num_seqs - 1)
    w = torch.where(rows < starts[num_seqs], observe[:num_rows].float(), torch.zeros((), device=dev))
    count = torch.zeros(num_seqs, device=dev).index_add_(0, seq, w)
    return seq, w, count
