"""Hydragen's Triton kernels and their launcher.

* :func:`_prefix_kernel`: one program per (group, KV head, tile of stacked query rows). The
  rows are every new token of every sequence in the group times the query heads of the KV
  head (GQA), so the group's blocks are loaded once per tile and the work is two matrix
  products per block (``tl.dot``), flash-attention style (online softmax). No mask: group
  blocks precede every query (see ``policy``).
* :func:`_suffix_kernel`: decode attention of one token (all query heads of one KV head)
  over its sequence's own blocks from its suffix start, causally masked.
* :func:`_merge_kernel`: per token and head, the suffix partial merged with the token's
  prefix partials (one per tree level) by log-sum-exp, written in the output dtype. Where the
  route provides vLLM's ``merge_attn_states`` (an attention plugin active on vLLM) it does the
  merge instead (``engine_merge.py``); else, on CUDA with FlashInfer usable,
  ``flashinfer.cascade.merge_state`` (``flashinfer.py``, chosen once and logged).

Caches are read through ``layer.kv_layout.split`` with the K and V views' own strides (block,
head, token; unit stride along D), so any layout and physical order works.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ....hooks import AttentionLayer, PagedBatch

from .._kernel import attend_rows, group_query, online_softmax_start
from .._shared import cache_strides

from .engine_merge import engine_merge, merge_partials_with
from .flashinfer import merge_partials, use_flashinfer_merge
from .policy import StepPlan, group_rows


@triton.jit
def _prefix_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    grp_row_start,
    rows,
    grp_blk_start,
    blks,
    sq_t,
    sq_h,
    sk_n,
    sk_h,
    sk_t,
    sv_n,
    sv_h,
    sv_t,
    so_r,
    so_h,
    slse_r,
    scale,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    PREC: tl.constexpr,
):
    grp = tl.program_id(0)
    kvh = tl.program_id(1)
    tile = tl.program_id(2)
    r0 = tl.load(grp_row_start + grp)
    r1 = tl.load(grp_row_start + grp + 1)
    n_m = (r1 - r0) * G
    if tile * BLOCK_M >= n_m:
        return
    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < n_m
    row = r0 + m // G
    head = kvh * G + m % G
    tok = tl.load(rows + row, mask=m_ok, other=0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(
        Q + tok[:, None] * sq_t + head[:, None] * sq_h + d[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0
    )
    t = tl.arange(0, BS)
    b0 = tl.load(grp_blk_start + grp)
    b1 = tl.load(grp_blk_start + grp + 1)
    m_i, l_i, acc = online_softmax_start(BLOCK_M, BLOCK_D)
    for j in range(b0, b1):
        blk = tl.load(blks + j).to(tl.int64)
        k_rows = blk * sk_n + kvh * sk_h + t * sk_t
        v_rows = blk * sv_n + kvh * sv_h + t * sv_t
        m_i, l_i, acc = attend_rows(
            m_i, l_i, acc, q, K, V, k_rows, v_rows, d, t < BS, d_ok, scale, PREC == "ieee", False, False
        )
    o = acc / l_i[:, None]
    tl.store(O + row[:, None] * so_r + head[:, None] * so_h + d[None, :], o, mask=m_ok[:, None] & d_ok[None, :])
    tl.store(LSE + row * slse_r + head, m_i + tl.log(l_i), mask=m_ok)


@triton.jit
def _suffix_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    tok_seq,
    tok_pos,
    seq_start_blk,
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
    slse_t,
    scale,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    PREC: tl.constexpr,
):
    tk = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(tok_seq + tk).to(tl.int64)
    pos = tl.load(tok_pos + tk)
    b0 = tl.load(seq_start_blk + seq)
    q, head, g_ok, d, d_ok = group_query(Q, tk, kvh, sq_t, sq_h, G, D, BLOCK_G, BLOCK_D)
    t = tl.arange(0, BS)
    m_i, l_i, acc = online_softmax_start(BLOCK_G, BLOCK_D)
    for lb in range(b0, pos // BS + 1):
        blk = tl.load(BT + seq * sbt + lb).to(tl.int64)
        k_rows = blk * sk_n + kvh * sk_h + t * sk_t
        v_rows = blk * sv_n + kvh * sv_h + t * sv_t
        causal = lb * BS + t <= pos
        m_i, l_i, acc = attend_rows(
            m_i, l_i, acc, q, K, V, k_rows, v_rows, d, causal, d_ok, scale, PREC == "ieee", False, False
        )
    o = acc / l_i[:, None]
    tl.store(O + tk * so_t + head[:, None] * so_h + d[None, :], o, mask=g_ok[:, None] & d_ok[None, :])
    tl.store(LSE + tk * slse_t + head, m_i + tl.log(l_i), mask=g_ok)


@triton.jit
def _merge_kernel(
    OS,
    LSES,
    OP,
    LSEP,
    part_start,
    part_rows,
    OUT,
    so_t,
    so_h,
    slse_t,
    sp_r,
    sp_h,
    slp_r,
    sout_t,
    sout_h,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tk = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    o = tl.load(OS + tk * so_t + h * so_h + d, mask=d_ok, other=0.0)
    lse = tl.load(LSES + tk * slse_t + h)
    k0 = tl.load(part_start + tk)
    k1 = tl.load(part_start + tk + 1)
    for k in range(k0, k1):
        r = tl.load(part_rows + k).to(tl.int64)
        o2 = tl.load(OP + r * sp_r + h * sp_h + d, mask=d_ok, other=0.0)
        lse2 = tl.load(LSEP + r * slp_r + h)
        mx = tl.maximum(lse, lse2)
        w1 = tl.exp(lse - mx)
        w2 = tl.exp(lse2 - mx)
        o = (o * w1 + o2 * w2) / (w1 + w2)
        lse = mx + tl.log(w1 + w2)
    tl.store(OUT + tk * sout_t + h * sout_h + d, o.to(OUT.dtype.element_ty), mask=d_ok)


BLOCK_M = 32


def _indices(plan: StepPlan, block_size: int, device: torch.device) -> dict[str, torch.Tensor | int]:
    """The plan as index tensors (built once per step and device, shared by every layer)."""
    key = ("triton", block_size, str(device))
    got = plan.cache.get(key)
    if got is not None:
        return got
    tree = plan.prefixes(block_size)
    tok_seq: list[int] = []
    tok_pos: list[int] = []
    for i, n in enumerate(plan.seq_lens):
        q = plan.q_lens[i]
        tok_seq += [i] * q
        tok_pos += range(n - q, n)
    num_tokens = len(tok_seq)
    rows: list[int] = []
    blks: list[int] = []
    grp_row_start, grp_blk_start = [0], [0]
    parts: list[list[int]] = [[] for _ in range(num_tokens)]
    max_rows = 0
    for g in tree.groups:
        mine = group_rows(plan, g.seqs)
        for tok in mine:
            parts[tok].append(len(rows))
            rows.append(tok)
        grp_row_start.append(len(rows))
        blks += g.blocks
        grp_blk_start.append(len(blks))
        max_rows = max(max_rows, len(mine))
    part_start, part_rows = [0], []
    for p in parts:
        part_rows += p
        part_start.append(len(part_rows))

    def t(x):
        return torch.tensor(x if x else [0], dtype=torch.int32, device=device)

    got = {
        "tok_seq": t(tok_seq),
        "tok_pos": t(tok_pos),
        "start_blk": t(list(tree.suffix_start)),
        "grp_row_start": t(grp_row_start),
        "rows": t(rows),
        "grp_blk_start": t(grp_blk_start),
        "blks": t(blks),
        "part_start": t(part_start),
        "part_rows": t(part_rows),
        "num_groups": len(tree.groups),
        "num_rows": len(rows),
        "max_rows": max_rows,
    }
    plan.cache[key] = got
    return got


def hydragen_attention_triton(
    query: torch.Tensor, kv_cache: torch.Tensor, batch: PagedBatch, layer: AttentionLayer, plan: StepPlan
) -> torch.Tensor:
    num_tokens, num_heads, d = query.shape
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    if query.stride(-1) != 1:
        query = query.contiguous()
    bs = kv_cache.shape[2]
    hkv = layer.num_kv_heads
    g = num_heads // hkv
    ix = _indices(plan, bs, query.device)
    k_cache, v_cache = layer.kv_layout.split(kv_cache)
    strides = cache_strides(k_cache, v_cache, "hydragen triton kernel")
    prec = "ieee" if query.dtype == torch.float32 else None
    block_d = triton.next_power_of_2(d)
    dev = query.device
    o_s = torch.empty((num_tokens, num_heads, d), dtype=torch.float32, device=dev)
    lse_s = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=dev)
    table = batch.block_table
    _suffix_kernel[(num_tokens, hkv)](
        query,
        k_cache,
        v_cache,
        o_s,
        lse_s,
        ix["tok_seq"],
        ix["tok_pos"],
        ix["start_blk"],
        table,
        table.stride(0),
        query.stride(0),
        query.stride(1),
        *strides,
        o_s.stride(0),
        o_s.stride(1),
        lse_s.stride(0),
        layer.scale,
        G=g,
        D=d,
        BLOCK_D=block_d,
        BS=bs,
        BLOCK_G=max(16, triton.next_power_of_2(g)),
        PREC=prec,
    )
    nr = max(ix["num_rows"], 1)
    o_p = torch.empty((nr, num_heads, d), dtype=torch.float32, device=dev)
    lse_p = torch.empty((nr, num_heads), dtype=torch.float32, device=dev)
    if ix["num_groups"]:
        grid = (ix["num_groups"], hkv, triton.cdiv(ix["max_rows"] * g, BLOCK_M))
        _prefix_kernel[grid](
            query,
            k_cache,
            v_cache,
            o_p,
            lse_p,
            ix["grp_row_start"],
            ix["rows"],
            ix["grp_blk_start"],
            ix["blks"],
            query.stride(0),
            query.stride(1),
            *strides,
            o_p.stride(0),
            o_p.stride(1),
            lse_p.stride(0),
            layer.scale,
            G=g,
            D=d,
            BLOCK_D=block_d,
            BS=bs,
            BLOCK_M=BLOCK_M,
            PREC=prec,
        )
    merge = engine_merge()
    if merge is not None:  # vLLM's merge_attn_states where the route provides it (CUDA first)
        return merge_partials_with(merge, (o_s, lse_s, o_p, lse_p), ix, plan, bs, out)
    if use_flashinfer_merge(query):  # else FlashInfer's cascade merge_state where it may run
        return merge_partials(o_s, lse_s, o_p, lse_p, ix, plan, bs, out)
    _merge_kernel[(num_tokens, num_heads)](
        o_s,
        lse_s,
        o_p,
        lse_p,
        ix["part_start"],
        ix["part_rows"],
        out,
        o_s.stride(0),
        o_s.stride(1),
        lse_s.stride(0),
        o_p.stride(0),
        o_p.stride(1),
        lse_p.stride(0),
        out.stride(0),
        out.stride(1),
        D=d,
        BLOCK_D=block_d,
    )
    return out
