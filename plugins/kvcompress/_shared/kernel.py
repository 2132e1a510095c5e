"""Triton decode attention over a paged KV cache that also emits per-block attention mass
(``kernel: triton`` of the scored compressors, ``h2o`` and ``snapkv``).

Flash-decoding shaped (the first GPU run, BENCHMARKS.md "GPU kernel timings", found the
earlier one-program-per-query-head, one-page-per-step kernel at 0.07x plain attention):

* ``_mass_split_kernel``, one program per (sequence, KV head, split of the context): the
  ``GROUP`` query heads of that KV head together (the keys and values read once for all of
  them, scores by ``tl.dot``), ``PAGES`` pages of the block table per step. It keeps the online
  softmax state of its split (max ``m``, sum ``l``, accumulator) and stores each page's own max
  and exp-sum per query head;
* ``_mass_reduce_kernel``, one program per (sequence, query head): merges the splits into the
  output and turns each page's statistics into its share of the final softmax,
  ``l_b * exp(m_b - m) / l``.

The number of splits is chosen from the block table's width and the device's SM count, never
from the sequences' lengths (no host read). Rows with more than one query (prefill chunks) go
through the reference (the attention kind's shared exact attention with mass).

Per KV head (a per-head compressor, e.g. ``adakv``): with a head mask ``[S, H_kv, max_blocks]``
(``HAS_MASK``) a program leaves out the pages its KV head does not read (they add nothing to the
online softmax; their mass is 0), and the launcher sums the mass over each KV head's group of
query heads instead of over all heads.

Shapes and strides: query ``[T, H, D]``; key/value caches ``[num_blocks, H_kv, B, D]``
(``layer.kv_layout.split`` of the layer's ``[num_blocks, H_kv, B, 2*D]``: each read with its own
strides, so any layout and physical order works, including ``cpu_vec``'s keys, whose stride along
D is the block size; Triton specialises a unit stride, so the other layouts load as before); block table
``[S, max_blocks]``; head mask ``[S, H_kv, max_blocks]`` (int8); out ``[T, H, D]``; mass
``[S, H, max_blocks]`` (summed over heads, or over each KV head's group, by the launcher).
``B`` and ``D`` must be powers of two (vLLM CPU: B a multiple of 32).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ....hooks import AttentionLayer, PagedBatch
from ...attention._kernel import FLOOR, online_softmax_start, online_softmax_step, qk_scores
from ...attention._shared import paged_attention_with_mass


@triton.jit
def _mass_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    lens_ptr,
    qrow_ptr,
    bm_ptr,
    bl_ptr,
    hm_ptr,
    pm_ptr,
    pl_ptr,
    pacc_ptr,
    s_qt,
    s_qh,
    s_kn,
    s_kh,
    s_kb,
    s_kd,
    s_vn,
    s_vh,
    s_vb,
    s_vd,
    s_tt,
    s_ms,
    s_mh,
    s_hs,
    s_hh,
    s_ps,
    s_ph,
    s_pp,
    scale,
    pages_per_split,
    GROUP: tl.constexpr,
    GP: tl.constexpr,
    B: tl.constexpr,
    D: tl.constexpr,
    PAGES: tl.constexpr,
    HAS_MASK: tl.constexpr,
    IEEE: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    L = tl.load(lens_ptr + seq)
    row = tl.load(qrow_ptr + seq)
    nb = tl.cdiv(L, B)
    first = split * pages_per_split
    last = tl.minimum(first + pages_per_split, nb)
    g = tl.arange(0, GP)
    heads = kvh * GROUP + g
    live = g < GROUP
    d = tl.arange(0, D)
    q = tl.load(q_ptr + row * s_qt + heads[:, None] * s_qh + d[None, :], mask=live[:, None], other=0.0)
    tok = tl.arange(0, PAGES * B)
    page_of = tok // B
    pg = tl.arange(0, PAGES)
    m, l, acc = online_softmax_start(GP, D)
    for c in range(first, last, PAGES):
        page = c + page_of
        valid = (page < last) & (page * B + tok % B < L)
        bid = tl.load(table_ptr + seq * s_tt + page, mask=page < last, other=0).to(tl.int64)
        if HAS_MASK:  # the pages this KV head does not read: no key is valid
            reads = tl.load(hm_ptr + seq * s_hs + kvh * s_hh + page, mask=page < last, other=0)
            valid = valid & (reads != 0)
        k = tl.load(
            k_ptr + bid[:, None] * s_kn + kvh * s_kh + (tok % B)[:, None] * s_kb + d[None, :] * s_kd,
            mask=valid[:, None],
            other=0.0,
        )
        s = tl.where(valid[None, :], qk_scores(q, k, scale, IEEE), float("-inf"))  # [GP, PAGES * B]
        s3 = tl.reshape(s, (GP, PAGES, B))
        m_b = tl.maximum(tl.max(s3, axis=2), FLOOR)  # [GP, PAGES]
        l_b = tl.sum(tl.exp(s3 - m_b[:, :, None]), axis=2)
        at = seq * s_ms + heads[:, None] * s_mh + (c + pg)[None, :]
        keep = live[:, None] & ((c + pg) < last)[None, :]
        tl.store(bm_ptr + at, m_b, mask=keep)
        tl.store(bl_ptr + at, l_b, mask=keep)
        v = tl.load(
            v_ptr + bid[:, None] * s_vn + kvh * s_vh + (tok % B)[:, None] * s_vb + d[None, :] * s_vd,
            mask=valid[:, None],
            other=0.0,
        )
        # the running max floored as the pages' maxes are: max(m, max_b m_b) as before
        m, l, acc = online_softmax_step(m, l, acc, s, v, IEEE, False, True)
    at = seq * s_ps + heads * s_ph + split * s_pp
    tl.store(pm_ptr + at, m, mask=live)
    tl.store(pl_ptr + at, l, mask=live)
    tl.store(pacc_ptr + (at * D)[:, None] + d[None, :], acc, mask=live[:, None])


@triton.jit
def _mass_reduce_kernel(
    lens_ptr,
    qrow_ptr,
    out_ptr,
    mass_ptr,
    bm_ptr,
    bl_ptr,
    pm_ptr,
    pl_ptr,
    pacc_ptr,
    s_ot,
    s_oh,
    s_ms,
    s_mh,
    s_ps,
    s_ph,
    s_pp,
    n_split,
    B: tl.constexpr,
    D: tl.constexpr,
    SP: tl.constexpr,
    CHUNK: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    L = tl.load(lens_ptr + seq)
    row = tl.load(qrow_ptr + seq)
    sp = tl.arange(0, SP)
    d = tl.arange(0, D)
    at = seq * s_ps + head * s_ph + sp * s_pp
    m_i = tl.load(pm_ptr + at, mask=sp < n_split, other=float("-inf"))
    l_i = tl.load(pl_ptr + at, mask=sp < n_split, other=0.0)
    acc_i = tl.load(pacc_ptr + (at * D)[:, None] + d[None, :], mask=(sp < n_split)[:, None], other=0.0)
    m = tl.maximum(tl.max(m_i, axis=0), FLOOR)  # floored: a sequence of length 0 has no key
    w = tl.exp(m_i - m)
    l = tl.sum(l_i * w, axis=0)
    l = tl.where(l > 0, l, 1.0)
    out = tl.sum(acc_i * w[:, None], axis=0) / l
    # a sequence of length 0 (a padded or query-less row) writes nothing: its row may be another's
    tl.store(out_ptr + row * s_ot + head * s_oh + d, out.to(out_ptr.dtype.element_ty), mask=(d * 0 + L) > 0)
    nb = tl.cdiv(L, B)
    for c in range(0, nb, CHUNK):
        pages = c + tl.arange(0, CHUNK)
        ok = pages < nb
        base = seq * s_ms + head * s_mh + pages
        m_b = tl.load(bm_ptr + base, mask=ok, other=FLOOR)
        l_b = tl.load(bl_ptr + base, mask=ok, other=0.0)
        tl.store(mass_ptr + base, l_b * tl.exp(m_b - m) / l, mask=ok)


#: tuning knobs read at each launch (benchmarks/gpu/sweep_mass.py varies them on a GPU)
KEYS_PER_STEP = 64
NUM_WARPS = 4
PROGRAMS_PER_SM = 4


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _split_count(device: torch.device, programs: int, width: int, pages: int) -> int:
    """Splits of the context so that about ``PROGRAMS_PER_SM`` programs per SM run (from the device's SM
    count, read once), at most one per ``pages`` pages of the block table's width."""
    sms = 1
    if device.type == "cuda":
        sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return max(1, min(triton.cdiv(PROGRAMS_PER_SM * sms, max(programs, 1)), triton.cdiv(width, pages)))


def decode_attention_with_mass(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_rows: torch.Tensor,
    scale: float,
    head_mask: torch.Tensor | None = None,
    splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention for the sequences whose single query is row ``query_rows[s]`` of
    ``query``: ``(out [len(query_rows), H, D], mass [S, H, max_blocks])`` (fp32 mass). With
    ``head_mask [S, H_kv, max_blocks]`` (bool), KV head h of sequence s reads only the columns
    where it is True (the sequence's last block must be one of them). ``splits`` fixes the
    number of context splits (tests; default: from the SM count)."""
    out, mass = _decode_all_rows(query, k_cache, v_cache, block_table, seq_lens, query_rows, scale, head_mask, splits)
    return out[query_rows.long()], mass


def _decode_all_rows(
    query, k_cache, v_cache, block_table, seq_lens, query_rows, scale, head_mask=None, splits=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`decode_attention_with_mass` with the output as ``[T, H, D]`` in ``query``'s rows:
    sequence s writes row ``query_rows[s]``, a sequence of length 0 writes nothing (rows no
    sequence writes are 0) and has no mass."""
    S = query_rows.numel()
    T, H, D = query.shape
    Hkv, B = k_cache.shape[1], k_cache.shape[2]
    if (B & (B - 1)) or (D & (D - 1)):
        raise ValueError(f"block size {B} and head size {D} must be powers of two for the Triton kernel")
    strides = (*k_cache.stride(), *v_cache.stride())  # any stride along D too (cpu_vec's keys)
    if query.dtype != k_cache.dtype:
        raise ValueError(f"attention-with-mass triton kernel: query {query.dtype} and cache {k_cache.dtype} differ")
    if query.stride(2) != 1:
        query = query.contiguous()
    group = H // Hkv
    width = block_table.shape[1]
    pages = max(1, KEYS_PER_STEP // B)
    n_split = splits or _split_count(query.device, S * Hkv, width, pages)
    per_split = triton.cdiv(triton.cdiv(width, n_split), pages) * pages
    n_split = triton.cdiv(width, per_split)
    dev = query.device
    out = torch.zeros(T, H, D, dtype=query.dtype, device=dev)
    mass = torch.zeros(S, H, width, dtype=torch.float32, device=dev)
    bm = torch.empty_like(mass)
    bl = torch.empty_like(mass)
    pm = torch.empty(S, H, n_split, dtype=torch.float32, device=dev)
    pl = torch.empty_like(pm)
    pacc = torch.empty(S, H, n_split, D, dtype=torch.float32, device=dev)
    table = block_table.contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    rows = query_rows.to(torch.int32).contiguous()
    hm = lens if head_mask is None else head_mask.to(torch.int8).contiguous()  # lens: an unread placeholder
    s_hs, s_hh = (0, 0) if head_mask is None else (hm.stride(0), hm.stride(1))
    _mass_split_kernel[(S, Hkv, n_split)](
        query,
        k_cache,
        v_cache,
        table,
        lens,
        rows,
        bm,
        bl,
        hm,
        pm,
        pl,
        pacc,
        query.stride(0),
        query.stride(1),
        *strides,
        table.stride(0),
        mass.stride(0),
        mass.stride(1),
        s_hs,
        s_hh,
        pm.stride(0),
        pm.stride(1),
        pm.stride(2),
        float(scale),
        per_split,
        GROUP=group,
        GP=max(16, triton.next_power_of_2(group)),
        B=B,
        D=D,
        PAGES=pages,
        HAS_MASK=head_mask is not None,
        IEEE=query.dtype == torch.float32,
        num_warps=NUM_WARPS,
    )
    _mass_reduce_kernel[(S, H)](
        lens,
        rows,
        out,
        mass,
        bm,
        bl,
        pm,
        pl,
        pacc,
        out.stride(0),
        out.stride(1),
        mass.stride(0),
        mass.stride(1),
        pm.stride(0),
        pm.stride(1),
        pm.stride(2),
        n_split,
        B=B,
        D=D,
        SP=max(2, triton.next_power_of_2(n_split)),
        CHUNK=128,
    )
    return out, mass


def _fold_heads(mass: torch.Tensor, weight: torch.Tensor, hkv: int, per_head: bool) -> torch.Tensor:
    """The kernel's per-query-head mass ``[S, H, width]`` summed over all heads (``[S, width]``),
    or per KV head over its group of query heads (``[S, H_kv, width]``), times ``weight [S]``."""
    S, _, width = mass.shape
    if per_head:
        return mass.view(S, hkv, -1, width).sum(2) * weight[:, None, None]
    return mass.sum(1) * weight[:, None]


def attention_with_mass(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: PagedBatch,
    layer: AttentionLayer,
    observe: torch.Tensor,
    head_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``KVCompressor.attend`` with the Triton kernel for decode rows (one query) and the
    reference for the others; with ``head_mask`` (a per-head compressor's), per KV head."""
    qsl = batch.query_start_loc
    qlen = (qsl[1:] - qsl[:-1]).long()
    hkv, width = layer.num_kv_heads, batch.block_table.shape[1]
    if batch.max_query_len == 1:  # decodes only (the route says so on the host): no host sync
        k_cache, v_cache = layer.kv_layout.split(kv_cache)
        lens = torch.where(qlen == 1, batch.seq_lens, torch.zeros_like(batch.seq_lens))
        out, d_mass = _decode_all_rows(
            query, k_cache, v_cache, batch.block_table, lens, qsl[:-1], layer.scale, head_mask
        )
        w = observe[qsl[:-1].long().clamp(max=max(query.shape[0] - 1, 0))].to(torch.float32) * (lens > 0)
        return out, _fold_heads(d_mass, w, hkv, per_head=head_mask is not None)
    decode = (qlen == 1) & (batch.seq_lens > 0)
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
        d_out, d_mass = decode_attention_with_mass(
            query,
            k_cache,
            v_cache,
            batch.block_table[seqs],
            batch.seq_lens[seqs],
            rows,
            layer.scale,
            None if head_mask is None else head_mask[seqs],
        )
        out[rows] = d_out
        mass[seqs] = _fold_heads(d_mass, observe[rows].to(torch.float32), hkv, per_head=head_mask is not None)
    return out, mass
