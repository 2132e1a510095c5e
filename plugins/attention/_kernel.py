"""The Triton pieces the attention kernels share: a tile of scores and FlashAttention's online
softmax (a running max, sum and unnormalised output per query row, one tile of keys at a time).

Used by hydragen's prefix and suffix kernels, squeezed's sparse decode, the scored KV
compressors' attention with mass (``kvcompress/_shared/kernel.py``) and tree attention
(``speculative/_tree/kernel.py``). ``IEEE`` multiplies in float32 at IEEE precision (float32
caches; tree attention's bfloat16 under Triton's interpreter too), else the tiles go to
``tl.dot`` in their own dtype (float32 accumulated).
"""

from __future__ import annotations

import triton
import triton.language as tl

#: a finite floor for a running (or a page's) max, so that a row with no valid key so far
#: keeps ``exp(-inf - floor) = 0`` instead of NaN
FLOOR = tl.constexpr(-1e30)


@triton.jit
def qk_scores(q, k, scale, IEEE: tl.constexpr):
    """``q [R, D] @ k [T, D]^T`` in float32, times ``scale``."""
    if IEEE:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    return s * scale


@triton.jit
def online_softmax_start(R: tl.constexpr, D: tl.constexpr):
    """The empty state of ``R`` rows of width ``D``: max -inf, sum 0, output 0 (float32)."""
    return tl.full([R], float("-inf"), tl.float32), tl.zeros([R], tl.float32), tl.zeros([R, D], tl.float32)


@triton.jit
def online_softmax_step(m, l, acc, s, v, IEEE: tl.constexpr, EXP2: tl.constexpr, FLOORED: tl.constexpr):
    """Fold one tile's scores ``s [R, T]`` (-inf where masked; log2 units with ``EXP2``) and
    values ``v [T, D]`` into the state ``(m [R], l [R], acc [R, D])``; with ``FLOORED`` the
    running max is at least :data:`FLOOR` (for rows that may see a tile with no valid key)."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    if FLOORED:
        m_new = tl.maximum(m_new, FLOOR)
    if EXP2:
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
    else:
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    if IEEE:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l, acc


@triton.jit
def group_query(
    Q, tok, kvh, sq_t, sq_h, G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr
):
    """The queries of the ``G`` query heads that share KV head ``kvh`` (GQA) at token ``tok``:
    ``q [BLOCK_G, BLOCK_D]`` (0 past ``G`` and ``D``) and its ``head``, ``g_ok``, ``d``, ``d_ok``."""
    g = tl.arange(0, BLOCK_G)
    g_ok = g < G
    head = kvh * G + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(Q + tok * sq_t + head[:, None] * sq_h + d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    return q, head, g_ok, d, d_ok


@triton.jit
def attend_rows(
    m,
    l,
    acc,
    q,
    K,
    V,
    k_rows,
    v_rows,
    cols,
    ok,
    cols_ok,
    scale,
    IEEE: tl.constexpr,
    EXP2: tl.constexpr,
    FLOORED: tl.constexpr,
):
    """Fold ``T`` cached keys and values into the online-softmax state ``(m, l, acc)`` of ``q``:
    the rows at ``K + k_rows`` and ``V + v_rows`` ([T] offsets; ``cols`` [D] the offsets along
    D, valid where ``cols_ok``), the keys valid where ``ok`` [T] (the others neither read nor
    attended)."""
    mask = ok[:, None] & cols_ok[None, :]
    k = tl.load(K + k_rows[:, None] + cols[None, :], mask=mask, other=0.0)
    s = tl.where(ok[None, :], qk_scores(q, k, scale, IEEE), float("-inf"))
    v = tl.load(V + v_rows[:, None] + cols[None, :], mask=mask, other=0.0)
    return online_softmax_step(m, l, acc, s, v, IEEE, EXP2, FLOORED)
