"""`squeezed`'s Triton kernels: chunk scoring and gather-based sparse decode attention.

* :func:`_chunk_score_kernel`: one program per (decode token, KV head): for every chunk of its
  context, the key centroid (mean over the chunk's valid tokens) dotted with the token's query
  heads of that KV head, the best head's score kept.
* :func:`_sparse_decode_kernel`: one program per (decode token, KV head): attention over only the
  chunks listed for it (gathered through the block table), flash-style online softmax.

The choice of chunks between the two (top-k over the scores plus the forced sink and window
chunks) runs in PyTorch (:func:`.reference.chosen_chunks`), the same code as the reference path.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_graft.hooks import AttentionLayer, PagedBatch, split_kv_cache
from vllm_graft.plugins.attention.noop.reference import gather_kv

from .reference import (causal_attention, choose, chosen_chunks, full_step, refresh_key, reuse_selection,
                        scoring_heads, sparse_rows)


@triton.jit
def _chunk_score_kernel(Q, K, S, row_tok, row_seq, row_len, BT, sbt, sq_t, sq_h, sk_n, sk_h, sk_t,
                        ss_r, ss_h, scale, G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                        BS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_G: tl.constexpr):
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    tok = tl.load(row_tok + r).to(tl.int64)
    seq = tl.load(row_seq + r).to(tl.int64)
    n = tl.load(row_len + r)
    g = tl.arange(0, BLOCK_G)
    g_ok = g < G
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(Q + tok * sq_t + (kvh * G + g)[:, None] * sq_h + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    j = tl.arange(0, CHUNK)
    for c in range(0, tl.cdiv(n, CHUNK)):
        first = c * CHUNK
        blk = tl.load(BT + seq * sbt + first // BS).to(tl.int64)
        t_ok = first + j < n
        k = tl.load(K + blk * sk_n + kvh * sk_h + ((first % BS) + j)[:, None] * sk_t + d[None, :],
                    mask=t_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        cnt = tl.minimum(n - first, CHUNK).to(tl.float32)
        cent = tl.sum(k, 0) / cnt  # [BLOCK_D]
        s = tl.sum(q * cent[None, :], 1) * scale  # [BLOCK_G]
        s = tl.where(g_ok, s, float("-inf"))
        tl.store(S + r * ss_r + kvh * ss_h + c, tl.max(s, 0))


@triton.jit
def _sparse_decode_kernel(Q, K, V, O, row_tok, row_seq, row_len, SEL, NSEL, BT, sbt,
                          sq_t, sq_h, sk_n, sk_h, sk_t, so_t, so_h, ssel_r, ssel_h, sn_r, scale,
                          G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BS: tl.constexpr,
                          CHUNK: tl.constexpr, TILE: tl.constexpr, BLOCK_G: tl.constexpr,
                          PREC: tl.constexpr):
    # TILE = max(CHUNK, 16) rows per chunk load (tl.dot needs at least 16; rows past CHUNK masked)
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    tok = tl.load(row_tok + r).to(tl.int64)
    seq = tl.load(row_seq + r).to(tl.int64)
    n = tl.load(row_len + r)
    g = tl.arange(0, BLOCK_G)
    g_ok = g < G
    head = kvh * G + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(Q + tok * sq_t + head[:, None] * sq_h + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    j = tl.arange(0, TILE)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    count = tl.load(NSEL + r * sn_r + kvh)
    for i in range(0, count):
        c = tl.load(SEL + r * ssel_r + kvh * ssel_h + i)
        first = c * CHUNK
        blk = tl.load(BT + seq * sbt + first // BS).to(tl.int64)
        t_ok = (j < CHUNK) & (first + j < n)
        off = blk * sk_n + kvh * sk_h + ((first % BS) + j)[:, None] * sk_t + d[None, :]
        k = tl.load(K + off, mask=t_ok[:, None] & d_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + off, mask=t_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(O + tok * so_t + head[:, None] * so_h + d[None, :], o.to(O.dtype.element_ty),
             mask=g_ok[:, None] & d_ok[None, :])


def chunk_scores_triton(query, kv_cache, batch, layer, chunk, rows, seqs, lens) -> torch.Tensor:
    """Scores [R, Hkv, C_max] of the decode rows (token ``rows[r]`` of sequence ``seqs[r]``
    with ``lens[r]`` context tokens); chunks past a row's context are left at -inf."""
    dev = query.device
    hkv, d = layer.num_kv_heads, layer.head_size
    g = layer.num_heads // hkv
    k_cache, _ = split_kv_cache(kv_cache)
    c_max = max(-(-n // chunk) for n in lens)
    scores = torch.full((len(rows), hkv, c_max), float("-inf"), dtype=torch.float32, device=dev)
    t = lambda x: torch.tensor(x, dtype=torch.int32, device=dev)  # noqa: E731
    table = batch.block_table
    _chunk_score_kernel[(len(rows), hkv)](
        query, k_cache, scores, t(rows), t(seqs), t(lens), table, table.stride(0),
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        scores.stride(0), scores.stride(1), layer.scale, G=g, D=d,
        BLOCK_D=triton.next_power_of_2(d), BS=kv_cache.shape[2], CHUNK=chunk,
        BLOCK_G=max(16, triton.next_power_of_2(g)))
    return scores


def sparse_decode_triton(query, kv_cache, batch, layer, chunk, rows, seqs, lens, sel_masks, out):
    """Attention of the decode rows over their chosen chunks (``sel_masks[r]`` bool [Hkv, C_r]),
    written into ``out``."""
    dev = query.device
    hkv, d = layer.num_kv_heads, layer.head_size
    g = layer.num_heads // hkv
    counts = torch.stack([m.sum(1) for m in sel_masks]).to(torch.int32)  # [R, Hkv]
    width = max(int(counts.max()), 1)
    sel = torch.zeros((len(rows), hkv, width), dtype=torch.int32, device=dev)
    for r, mk in enumerate(sel_masks):
        order = torch.argsort((~mk).to(torch.int8), dim=1, stable=True)[:, :width]  # chosen first
        sel[r, :, :order.shape[1]] = order.to(torch.int32)
    k_cache, v_cache = split_kv_cache(kv_cache)
    t = lambda x: torch.tensor(x, dtype=torch.int32, device=dev)  # noqa: E731
    table = batch.block_table
    _sparse_decode_kernel[(len(rows), hkv)](
        query, k_cache, v_cache, out, t(rows), t(seqs), t(lens), sel, counts.to(dev), table,
        table.stride(0), query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), out.stride(0), out.stride(1), sel.stride(0), sel.stride(1),
        counts.stride(0), layer.scale, G=g, D=d, BLOCK_D=triton.next_power_of_2(d),
        BS=kv_cache.shape[2], CHUNK=chunk, TILE=max(16, chunk), BLOCK_G=max(16, triton.next_power_of_2(g)),
        PREC="ieee" if query.dtype == torch.float32 else None)


def squeezed_attention_triton(m, query: torch.Tensor, kv_cache: torch.Tensor, batch: PagedBatch,
                              layer: AttentionLayer) -> torch.Tensor:
    p = m.params
    if query.stride(-1) != 1:
        query = query.contiguous()
    out = torch.empty_like(query)
    bs = kv_cache.shape[2]
    hkv = layer.num_kv_heads
    retrieval = m.retrieval(layer)
    qsl = batch.query_start_loc.tolist()
    rows, seqs, lens = [], [], []
    for i, n in enumerate(batch.seq_lens.tolist()):
        q0, q1 = qsl[i], qsl[i + 1]
        if q1 - q0 == 1:
            rows.append(q0)
            seqs.append(i)
            lens.append(n)
        elif q1 > q0:  # prefill / chunked prefill: the PyTorch path
            k, v = gather_kv(kv_cache, batch.block_table[i, : -(-n // bs)], n, layer.head_size)
            if p.prefill == "sparse":
                out[q0:q1] = sparse_rows(query[q0:q1], k, v, m, layer.scale, retrieval).to(query.dtype)
            else:
                out[q0:q1] = causal_attention(query[q0:q1], k, v, layer.scale).to(query.dtype)
    if not rows:
        return out
    budgets = [m.budget(n) for n in lens]
    need_scores = p.mode == "centroid" and any(not b.full for b in budgets)
    scores = chunk_scores_triton(query, kv_cache, batch, layer, p.chunk, rows, seqs, lens) \
        if need_scores else None
    masks = []
    k_cache, _ = split_kv_cache(kv_cache)
    for r, (b, n) in enumerate(zip(budgets, lens)):
        row = batch.block_table[seqs[r]]
        key_at = lambda pos, row=row: k_cache[int(row[pos // bs]), 0, pos % bs].float()  # noqa: E731
        mk = reuse_selection(m, layer, row, key_at, n, b, bs) if m.refreshing() else None
        s = None
        if mk is None:
            if p.mode == "recycled" and not b.full:  # the full step's mass: PyTorch (reference)
                k, _ = gather_kv(kv_cache, row[: -(-n // bs)], n, layer.head_size)
                mk, s = choose(m, query[rows[r]], k, b, layer, retrieval)
            else:
                s = scores[r, :, :b.num_chunks] if scores is not None and not b.full else None
                mk = chosen_chunks(s, b, p.mode, hkv, retrieval)
            if m.refreshing() and (n - 1) % p.refresh == 0:
                m.remember(refresh_key(layer, row, n - 1, bs), key_at(n - 1).clone(), mk)
        if p.mode == "recycled" and s is not None:  # the full step itself attends to everything
            mk = full_step(mk, retrieval)
        masks.append(mk)
        m.stats.add(n, hkv, int(mk.repeat_interleave(p.chunk, dim=1)[:, :n].sum()),
                    b.num_chunks * scoring_heads(hkv, retrieval) if s is not None and p.mode == "centroid" else 0)
    sparse_decode_triton(query, kv_cache, batch, layer, p.chunk, rows, seqs, lens, masks, out)
    return out
