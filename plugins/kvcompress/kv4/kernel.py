"""Triton paged attention over the kv4 cache: the 4-bit keys and values are unpacked and
dequantised inside the attention loop (never materialised in full precision).

One program per (query token, query head): the token's sequence and absolute position come
from the launcher; the program walks the blocks of its block-table row up to its position
(causal), and for each block loads the packed key bytes ``[B, D/2]``, the block's per-channel
key (scale, min), the packed value bytes and each token's value-group (scale, min), and
keeps the online-softmax state (running max, sum, accumulator) in float32. Even and odd
channels (low and high nibbles) are kept as two halves, so no interleave is needed.
GQA: query head ``h`` reads KV head ``h // (H / H_kv)``.

Float16 parameters are read as two bytes and bitcast (the page is ``uint8``). ``B`` and
``D/2`` must be powers of two (tl.arange); the layout is :mod:`.reference`'s (its offsets
from :mod:`.layout`). The page ``[N, H_kv, B, C]`` is read through the view's block, head and
token strides (a unit stride along ``C`` is required), so any physical order of the first three
dims works (vLLM's CUDA backends allocate NHD, ``[N, B, H_kv, C]``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ....hooks import AttentionLayer, PagedBatch

from .layout import offsets


@triton.jit
def _f16_at(ptr):
    """The float16 stored little-endian at byte pointers ``ptr`` (any shape), as float32."""
    lo = tl.load(ptr).to(tl.uint16)
    hi = tl.load(ptr + 1).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _kv4_attention_kernel(
    q_ptr,
    cache_ptr,
    table_ptr,
    seq_ptr,
    pos_ptr,
    out_ptr,
    s_qt,
    s_qh,
    s_cn,
    s_ch,
    s_cb,
    s_tt,
    s_ot,
    s_oh,
    scale,
    GROUP: tl.constexpr,
    B: tl.constexpr,
    D: tl.constexpr,
    HALF: tl.constexpr,
    G: tl.constexpr,
    NG: tl.constexpr,
    KP: tl.constexpr,
    KS: tl.constexpr,
):
    tok = tl.program_id(0)
    head = tl.program_id(1)
    kvh = head // GROUP
    seq = tl.load(seq_ptr + tok)
    pos = tl.load(pos_ptr + tok)
    c = tl.arange(0, HALF)  # channel pairs: channels 2c (low nibble) and 2c+1 (high nibble)
    t = tl.arange(0, B)
    q_even = tl.load(q_ptr + tok * s_qt + head * s_qh + 2 * c).to(tl.float32)
    q_odd = tl.load(q_ptr + tok * s_qt + head * s_qh + 2 * c + 1).to(tl.float32)
    # byte offsets of the block's per-channel key parameters (float16 [2, D] spread over the
    # B rows, KS bytes per row at offset KP): element x lives at row 2x // KS, byte 2x % KS
    xs_e = 2 * (2 * c)
    xs_o = 2 * (2 * c + 1)
    xm_e = 2 * (D + 2 * c)
    xm_o = 2 * (D + 2 * c + 1)
    off_ks_e = (xs_e // KS) * s_cb + KP + xs_e % KS
    off_ks_o = (xs_o // KS) * s_cb + KP + xs_o % KS
    off_km_e = (xm_e // KS) * s_cb + KP + xm_e % KS
    off_km_o = (xm_o // KS) * s_cb + KP + xm_o % KS
    g = (2 * c) // G  # value group of both channels of a pair (G is even)
    m = -float("inf")
    l = 0.0
    acc_e = tl.zeros([HALF], dtype=tl.float32)
    acc_o = tl.zeros([HALF], dtype=tl.float32)
    nb = pos // B + 1
    for j in range(0, nb):
        bid = tl.load(table_ptr + seq * s_tt + j).to(tl.int64)
        base = cache_ptr + bid * s_cn + kvh * s_ch
        valid = j * B + t <= pos
        rows = base + t[:, None] * s_cb
        kb = tl.load(rows + c[None, :], mask=valid[:, None], other=0)
        k_sc_e = _f16_at(base + off_ks_e)
        k_sc_o = _f16_at(base + off_ks_o)
        k_mn_e = _f16_at(base + off_km_e)
        k_mn_o = _f16_at(base + off_km_o)
        k_e = k_mn_e[None, :] + (kb & 15).to(tl.float32) * k_sc_e[None, :]
        k_o = k_mn_o[None, :] + (kb >> 4).to(tl.float32) * k_sc_o[None, :]
        s = tl.sum(k_e * q_even[None, :] + k_o * q_odd[None, :], axis=1) * scale
        s = tl.where(valid, s, -float("inf"))
        vb = tl.load(rows + HALF + c[None, :], mask=valid[:, None], other=0)
        v_sc = _f16_at(rows + D + 2 * g[None, :])
        v_mn = _f16_at(rows + D + 2 * NG + 2 * g[None, :])
        v_e = v_mn + (vb & 15).to(tl.float32) * v_sc
        v_o = v_mn + (vb >> 4).to(tl.float32) * v_sc
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        p = tl.where(valid, p, 0.0)
        l = l * alpha + tl.sum(p, axis=0)
        acc_e = acc_e * alpha + tl.sum(p[:, None] * v_e, axis=0)
        acc_o = acc_o * alpha + tl.sum(p[:, None] * v_o, axis=0)
        m = m_new
    o = out_ptr + tok * s_ot + head * s_oh
    tl.store(o + 2 * c, (acc_e / l).to(out_ptr.dtype.element_ty))
    tl.store(o + 2 * c + 1, (acc_o / l).to(out_ptr.dtype.element_ty))


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def paged_attention_kv4_triton(
    query: torch.Tensor, kv_cache: torch.Tensor, batch: PagedBatch, layer: AttentionLayer, value_group: int
) -> torch.Tensor:
    """``out [T, H, D]``: what :func:`.reference.paged_attention_kv4` computes (no mass)."""
    T, H, D = query.shape
    N, Hkv, B, C = kv_cache.shape
    if not (_pow2(B) and _pow2(D // 2)):
        raise ValueError(
            f"kv4 triton kernel: block size {B} and head size / 2 ({D // 2}) must be powers "
            "of two; use kernel: reference"
        )
    _, _, kp, ks = offsets(D, B, value_group)
    out = torch.zeros_like(query)
    qsl = batch.query_start_loc.long()
    q_lens = qsl[1:] - qsl[:-1]
    n = q_lens.numel()
    seq_of = torch.repeat_interleave(torch.arange(n, device=query.device), q_lens)
    first = batch.seq_lens[:n].long() - q_lens  # position of each sequence's first query
    pos = first[seq_of] + (torch.arange(seq_of.numel(), device=query.device) - qsl[:-1][seq_of])
    if seq_of.numel() == 0:
        return out
    rows = int(seq_of.numel())
    table = batch.block_table.contiguous()
    if kv_cache.stride(3) != 1:
        raise ValueError(
            f"kv4 triton kernel: the cache needs a unit stride along its byte dim, got strides "
            f"{tuple(kv_cache.stride())}; pass the layer's [N, H_kv, B, C] view of a cache whose "
            "last dim is contiguous"
        )
    cache = kv_cache
    _kv4_attention_kernel[(rows, H)](
        query,
        cache,
        table,
        seq_of.to(torch.int32).contiguous(),
        pos.to(torch.int32).contiguous(),
        out,
        query.stride(0),
        query.stride(1),
        cache.stride(0),
        cache.stride(1),
        cache.stride(2),
        table.stride(0),
        out.stride(0),
        out.stride(1),
        layer.scale,
        GROUP=H // Hkv,
        B=B,
        D=D,
        HALF=D // 2,
        G=value_group,
        NG=D // value_group,
        KP=kp,
        KS=ks,
    )
    return out
