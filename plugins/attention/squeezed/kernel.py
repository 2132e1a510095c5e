"""`squeezed`'s Triton kernels: chunk scoring and gather-based sparse decode attention.

* :func:`_chunk_score_kernel`: one program per (decode token, KV head): for every chunk of its
  context, the key centroid (mean over the chunk's valid tokens) dotted with the token's query
  heads of that KV head, the best head's score kept.
* :func:`_sparse_decode_kernel`: one program per (decode token, KV head): attention over only the
  chunks listed for it (gathered through the block table), flash-style online softmax
  (``attention/_kernel.py``'s, which hydragen's kernels use too).

:func:`chunk_scores_triton` and :func:`sparse_decode_triton` launch them. The choice of chunks
between the two (top-k over the scores plus the forced sink and window chunks) and the prefill
rows run in PyTorch, in ``reference.squeezed_attention_triton`` (the same code as the reference
path), which imports this module when ``kernel: triton`` is chosen; this module imports nothing
of the reference. The cache is read through ``layer.kv_layout.split``, each of K and V with its
own strides (block, head, token; unit stride along D), so any layout and physical order works.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._kernel import attend_rows, group_query, online_softmax_start
from .._shared import cache_strides


@triton.jit
def _chunk_score_kernel(
    Q,
    K,
    S,
    row_tok,
    row_seq,
    row_len,
    BT,
    sbt,
    sq_t,
    sq_h,
    sk_n,
    sk_h,
    sk_t,
    ss_r,
    ss_h,
    scale,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BS: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    tok = tl.load(row_tok + r).to(tl.int64)
    seq = tl.load(row_seq + r).to(tl.int64)
    n = tl.load(row_len + r)
    q, _, g_ok, d, d_ok = group_query(Q, tok, kvh, sq_t, sq_h, G, D, BLOCK_G, BLOCK_D)
    q = q.to(tl.float32)
    j = tl.arange(0, CHUNK)
    for c in range(0, tl.cdiv(n, CHUNK)):
        first = c * CHUNK
        blk = tl.load(BT + seq * sbt + first // BS).to(tl.int64)
        t_ok = first + j < n
        k = tl.load(
            K + blk * sk_n + kvh * sk_h + ((first % BS) + j)[:, None] * sk_t + d[None, :],
            mask=t_ok[:, None] & d_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        cnt = tl.minimum(n - first, CHUNK).to(tl.float32)
        cent = tl.sum(k, 0) / cnt  # [BLOCK_D]
        s = tl.sum(q * cent[None, :], 1) * scale  # [BLOCK_G]
        s = tl.where(g_ok, s, float("-inf"))
        tl.store(S + r * ss_r + kvh * ss_h + c, tl.max(s, 0))


@triton.jit
def _sparse_decode_kernel(
    Q,
    K,
    V,
    O,
    row_tok,
    row_seq,
    row_len,
    SEL,
    NSEL,
    BT,
    sbt,
    sq_t,
    sq_h,
    sk_n,
    sk_h,
    sk_t,
    sv_n,
    sv_h,
    sv_t,
    so_t,
    so_h,
    ssel_r,
    ssel_h,
    sn_r,
    scale,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BS: tl.constexpr,
    CHUNK: tl.constexpr,
    TILE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    PREC: tl.constexpr,
):
    # TILE = max(CHUNK, 16) rows per chunk load (tl.dot needs at least 16; rows past CHUNK masked)
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    tok = tl.load(row_tok + r).to(tl.int64)
    seq = tl.load(row_seq + r).to(tl.int64)
    n = tl.load(row_len + r)
    q, head, g_ok, d, d_ok = group_query(Q, tok, kvh, sq_t, sq_h, G, D, BLOCK_G, BLOCK_D)
    j = tl.arange(0, TILE)
    m_i, l_i, acc = online_softmax_start(BLOCK_G, BLOCK_D)
    count = tl.load(NSEL + r * sn_r + kvh)
    for i in range(0, count):
        c = tl.load(SEL + r * ssel_r + kvh * ssel_h + i)
        first = c * CHUNK
        blk = tl.load(BT + seq * sbt + first // BS).to(tl.int64)
        t_ok = (j < CHUNK) & (first + j < n)
        slot = (first % BS) + j
        k_rows = blk * sk_n + kvh * sk_h + slot * sk_t
        v_rows = blk * sv_n + kvh * sv_h + slot * sv_t
        m_i, l_i, acc = attend_rows(
            m_i, l_i, acc, q, K, V, k_rows, v_rows, d, t_ok, d_ok, scale, PREC == "ieee", False, False
        )
    o = acc / l_i[:, None]
    tl.store(
        O + tok * so_t + head[:, None] * so_h + d[None, :], o.to(O.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :]
    )


def chunk_scores_triton(query, kv_cache, batch, layer, chunk, rows, seqs, lens) -> torch.Tensor:
    """Scores [R, Hkv, C_max] of the decode rows (token ``rows[r]`` of sequence ``seqs[r]``
    with ``lens[r]`` context tokens); chunks past a row's context are left at -inf."""
    dev = query.device
    hkv, d = layer.num_kv_heads, layer.head_size
    g = layer.num_heads // hkv
    k_cache, v_cache = layer.kv_layout.split(kv_cache)
    sk = cache_strides(k_cache, v_cache, "squeezed triton kernel")[:3]
    c_max = max(-(-n // chunk) for n in lens)
    scores = torch.full((len(rows), hkv, c_max), float("-inf"), dtype=torch.float32, device=dev)
    t = lambda x: torch.tensor(x, dtype=torch.int32, device=dev)  # noqa: E731
    table = batch.block_table
    _chunk_score_kernel[(len(rows), hkv)](
        query,
        k_cache,
        scores,
        t(rows),
        t(seqs),
        t(lens),
        table,
        table.stride(0),
        query.stride(0),
        query.stride(1),
        *sk,
        scores.stride(0),
        scores.stride(1),
        layer.scale,
        G=g,
        D=d,
        BLOCK_D=triton.next_power_of_2(d),
        BS=kv_cache.shape[2],
        CHUNK=chunk,
        BLOCK_G=max(16, triton.next_power_of_2(g)),
    )
    return scores


def sparse_decode_triton(query, kv_cache, batch, layer, chunk, rows, seqs, lens, sel_masks, out, width=None):
    """Attention of the decode rows over their chosen chunks, written into ``out``: ``sel_masks``
    a bool ``[R, Hkv, C]`` tensor (``width``: at least the most chunks any row chooses, known on
    the host, so that nothing is read back from the device) or a list of bool ``[Hkv, C_r]``."""
    dev = query.device
    hkv, d = layer.num_kv_heads, layer.head_size
    g = layer.num_heads // hkv
    if not isinstance(sel_masks, torch.Tensor):  # per row, of its own chunk count: padded into one
        c_max = max(m.shape[1] for m in sel_masks)
        sel_masks = torch.stack([torch.nn.functional.pad(m, (0, c_max - m.shape[1])) for m in sel_masks])
    counts = sel_masks.sum(-1, dtype=torch.int32)  # [R, Hkv]
    if width is None:
        width = int(counts.max())  # a host read: the list form's callers know no bound
    c_max = sel_masks.shape[-1]
    ci = torch.arange(c_max, device=dev, dtype=torch.int32)
    # each (row, KV head)'s chosen chunks first, in position order (the kernel reads `counts` of them)
    sel = torch.where(sel_masks, ci, c_max).sort(dim=-1).values[..., : max(width, 1)].contiguous()
    k_cache, v_cache = layer.kv_layout.split(kv_cache)
    strides = cache_strides(k_cache, v_cache, "squeezed triton kernel")
    t = lambda x: torch.tensor(x, dtype=torch.int32, device=dev)  # noqa: E731
    table = batch.block_table
    _sparse_decode_kernel[(len(rows), hkv)](
        query,
        k_cache,
        v_cache,
        out,
        t(rows),
        t(seqs),
        t(lens),
        sel,
        counts.to(dev),
        table,
        table.stride(0),
        query.stride(0),
        query.stride(1),
        *strides,
        out.stride(0),
        out.stride(1),
        sel.stride(0),
        sel.stride(1),
        counts.stride(0),
        layer.scale,
        G=g,
        D=d,
        BLOCK_D=triton.next_power_of_2(d),
        BS=kv_cache.shape[2],
        CHUNK=chunk,
        TILE=max(16, chunk),
        BLOCK_G=max(16, triton.next_power_of_2(g)),
        PREC="ieee" if query.dtype == torch.float32 else None,
    )
