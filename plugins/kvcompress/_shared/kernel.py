"""Triton decode attention over a paged KV cache that also emits per-block attention mass
(``kernel: triton`` of the scored compressors, ``h2o`` and ``snapkv``).

One program per (sequence, query head): the sequence's single query (decode) walks the
blocks of its block-table row, keeping the online-softmax state (running max ``m``, sum
``l``, accumulator) and storing each block's own max and exp-sum; a second walk turns those
into the block's share of the final softmax, ``l_b * exp(m_b - m) / l``. Rows with more than
one query (prefill chunks) go through the reference (the attention kind's shared exact
attention with mass).

Per KV head (a per-head compressor, e.g. ``adakv``): with a head mask ``[S, H_kv, max_blocks]``
(``HAS_MASK``), a program skips the blocks its KV head does not read (they add nothing to the
online softmax; their mass is 0), and the launcher sums the mass over each KV head's group of
query heads instead of over all heads.

Shapes and strides: query ``[T, H, D]``; key/value caches ``[num_blocks, H_kv, B, D]``
(``layer.kv_layout.split`` of the layer's ``[num_blocks, H_kv, B, 2*D]``: each read with its own
strides, so any layout and physical order works; unit stride along D); block table
``[S, max_blocks]``; head mask ``[S, H_kv, max_blocks]`` (int8); out ``[T, H, D]``; mass
``[S, H, max_blocks]`` (summed over heads, or over each KV head's group, by the launcher).
``B`` and ``D`` must be powers of two (vLLM CPU: B a multiple of 32).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_graft.hooks import AttentionLayer, PagedBatch
from vllm_graft.plugins.attention._shared import cache_strides, paged_attention_with_mass


@triton.jit
def _decode_mass_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, qrow_ptr, out_ptr, mass_ptr, bm_ptr, bl_ptr, hm_ptr,
    s_qt, s_qh, s_kn, s_kh, s_kb, s_vn, s_vh, s_vb, s_tt, s_ot, s_oh, s_ms, s_mh, s_hs, s_hh,
    scale, GROUP: tl.constexpr, B: tl.constexpr, D: tl.constexpr, HAS_MASK: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kvh = head // GROUP
    L = tl.load(lens_ptr + seq)
    row = tl.load(qrow_ptr + seq)
    d = tl.arange(0, D)
    t = tl.arange(0, B)
    q = tl.load(q_ptr + row * s_qt + head * s_qh + d).to(tl.float32)
    m = -float("inf")
    l = 0.0
    acc = tl.zeros([D], dtype=tl.float32)
    nb = tl.cdiv(L, B)
    for b in range(0, nb):
        bid = tl.load(table_ptr + seq * s_tt + b).to(tl.int64)
        valid = b * B + t < L
        if HAS_MASK:  # the blocks this KV head does not read: no key is valid
            reads = tl.load(hm_ptr + seq * s_hs + kvh * s_hh + b).to(tl.int32)
            valid = b * B + t < L * reads
        k = tl.load(k_ptr + bid * s_kn + kvh * s_kh + t[:, None] * s_kb + d[None, :],
                    mask=valid[:, None], other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1) * scale
        s = tl.where(valid, s, -float("inf"))
        m_b = tl.max(s, axis=0)
        if HAS_MASK:  # a skipped block: a finite floor, so p = exp(-inf) = 0 (not NaN)
            m_b = tl.maximum(m_b, -1e30)
        p = tl.exp(s - m_b)
        l_b = tl.sum(p, axis=0)
        v = tl.load(v_ptr + bid * s_vn + kvh * s_vh + t[:, None] * s_vb + d[None, :],
                    mask=valid[:, None], other=0.0).to(tl.float32)
        acc_b = tl.sum(p[:, None] * v, axis=0)
        m_new = tl.maximum(m, m_b)
        a_old = tl.exp(m - m_new)
        a_new = tl.exp(m_b - m_new)
        acc = acc * a_old + acc_b * a_new
        l = l * a_old + l_b * a_new
        m = m_new
        tl.store(bm_ptr + seq * s_ms + head * s_mh + b, m_b)
        tl.store(bl_ptr + seq * s_ms + head * s_mh + b, l_b)
    tl.store(out_ptr + row * s_ot + head * s_oh + d, (acc / l).to(out_ptr.dtype.element_ty))
    for b in range(0, nb):
        m_b = tl.load(bm_ptr + seq * s_ms + head * s_mh + b)
        l_b = tl.load(bl_ptr + seq * s_ms + head * s_mh + b)
        tl.store(mass_ptr + seq * s_ms + head * s_mh + b, l_b * tl.exp(m_b - m) / l)


def decode_attention_with_mass(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_table: torch.Tensor, seq_lens: torch.Tensor, query_rows: torch.Tensor,
                               scale: float, head_mask: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention for the sequences whose single query is row ``query_rows[s]`` of
    ``query``: ``(out [len(query_rows), H, D], mass [S, H, max_blocks])`` (fp32 mass). With
    ``head_mask [S, H_kv, max_blocks]`` (bool), KV head h of sequence s reads only the columns
    where it is True (the sequence's last block must be one of them)."""
    S = query_rows.numel()
    T, H, D = query.shape
    Hkv, B = k_cache.shape[1], k_cache.shape[2]
    if (B & (B - 1)) or (D & (D - 1)):
        raise ValueError(f"block size {B} and head size {D} must be powers of two for the Triton kernel")
    strides = cache_strides(k_cache, v_cache, "attention-with-mass triton kernel")
    if query.stride(2) != 1:
        query = query.contiguous()
    width = block_table.shape[1]
    out = torch.zeros(T, H, D, dtype=query.dtype, device=query.device)
    mass = torch.zeros(S, H, width, dtype=torch.float32, device=query.device)
    bm = torch.empty_like(mass)
    bl = torch.empty_like(mass)
    table = block_table.contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    rows = query_rows.to(torch.int32).contiguous()
    hm = lens if head_mask is None else head_mask.to(torch.int8).contiguous()  # lens: an unread placeholder
    s_hs, s_hh = (0, 0) if head_mask is None else (hm.stride(0), hm.stride(1))
    _decode_mass_kernel[(S, H)](
        query, k_cache, v_cache, table, lens, rows, out, mass, bm, bl, hm,
        query.stride(0), query.stride(1), *strides, table.stride(0),
        out.stride(0), out.stride(1), mass.stride(0), mass.stride(1), s_hs, s_hh,
        float(scale), GROUP=H // Hkv, B=B, D=D, HAS_MASK=head_mask is not None,
    )
    return out[rows.long()], mass


def attention_with_mass(query: torch.Tensor, kv_cache: torch.Tensor, batch: PagedBatch,
                        layer: AttentionLayer, observe: torch.Tensor, head_mask: torch.Tensor | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``KVCompressor.attend`` with the Triton kernel for decode rows (one query) and the
    reference for the others; with ``head_mask`` (a per-head compressor's), per KV head."""
    qsl = batch.query_start_loc
    qlen = (qsl[1:] - qsl[:-1]).long()
    decode = (qlen == 1) & (batch.seq_lens > 0)
    hkv, width = layer.num_kv_heads, batch.block_table.shape[1]
    shape = (qlen.numel(), hkv, width) if head_mask is not None else (qlen.numel(), width)
    out, mass = torch.zeros_like(query), torch.zeros(shape, dtype=torch.float32, device=query.device)
    others = ~decode & (qlen > 0)
    if bool(others.any()):
        ref_out, ref_mass = paged_attention_with_mass(query, kv_cache, batch, layer, observe, head_mask=head_mask)
        out, mass = ref_out, ref_mass * others.view(-1, *([1] * (ref_mass.dim() - 1)))
    if bool(decode.any()):
        seqs = decode.nonzero().flatten()
        rows = qsl[:-1][seqs].long()
        k_cache, v_cache = layer.kv_layout.split(kv_cache)
        d_out, d_mass = decode_attention_with_mass(query, k_cache, v_cache, batch.block_table[seqs],
                                                   batch.seq_lens[seqs], rows, layer.scale,
                                                   None if head_mask is None else head_mask[seqs])
        out[rows] = d_out
        w = observe[rows].to(torch.float32)
        if head_mask is None:
            mass[seqs] = d_mass.sum(1) * w[:, None]
        else:  # per KV head: the sum over its group of query heads
            mass[seqs] = d_mass.view(len(seqs), hkv, -1, width).sum(2) * w[:, None, None]
    return out, mass
