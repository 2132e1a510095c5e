"""Triton tree attention for one sequence: the same result as :func:`.reference.tree_attention`
(shapes and meaning in that module's docstring).

One program per (node, kv head). It loads the queries of the kv head's whole query-head group
(``[GROUP, D]``, padded to a power of two), so each context block's keys and values are read
once per group rather than once per query head, and keeps one online-softmax state per query
head (running max ``m``, sum ``l``, accumulator ``acc``) over two phases:

1. the context: walk the block table, one ``[block_size, D]`` tile of keys/values per block,
   slots past ``context_len`` masked (the last block may be partial);
2. the tree: tiles of 32 tree nodes, each masked by one 32-bit word of the node's
   ancestor-or-self bitmask (bit ``j % 32`` of word ``j // 32`` of row ``i`` is set when node
   ``j`` is an ancestor-or-self of node ``i``). Ancestors have smaller indices (topological
   order), so node ``i`` reads only words ``0 .. i // 32``.

Why a bitmask rather than walking ``parents``: a parent walk is a chain of dependent scalar
loads (one key at a time, ``depth`` steps); the bitmask turns the tree into ordinary masked
tiles (32 keys per load, no data-dependent control flow), and costs ``N * ceil(N / 32)`` int32
words, built once per verify step on the host (:func:`pack_ancestor_bits`) and shared by every
layer and head. The tree part reads at most ``32 * ceil((i + 1) / 32)`` keys for node ``i``,
which for trees of tens of nodes is less than one context block.

Block size and head size need not be powers of two (tiles are padded and masked). The key and
value caches may have any strides except a unit stride along ``D``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import check_shapes
from .tree import ancestor_mask

WORD = 32  # tree nodes per tile: one int32 word of the bitmask


@triton.jit
def _softmax_step(m, l, acc, s, v):
    """Fold scores ``s [G, T]`` (-inf where masked) and values ``v [T, D]`` into the state."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # a row with nothing seen yet
    alpha = tl.exp(m - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
    return m_new, l, acc


@triton.jit
def _tree_attention_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    table_ptr,
    kt_ptr,
    vt_ptr,
    bits_ptr,
    out_ptr,
    context_len,
    n_nodes,
    n_words,
    s_qn,
    s_qh,
    s_kcn,
    s_kcb,
    s_kch,
    s_vcn,
    s_vcb,
    s_vch,
    s_ktn,
    s_kth,
    s_vtn,
    s_vth,
    s_on,
    s_oh,
    scale,
    GROUP: tl.constexpr,
    GP: tl.constexpr,
    B: tl.constexpr,
    BP: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    W: tl.constexpr,
):
    node = tl.program_id(0)
    kvh = tl.program_id(1)
    g = tl.arange(0, GP)
    d = tl.arange(0, DP)
    hm = g < GROUP
    dm = d < D
    heads = kvh * GROUP + g
    q = (
        tl.load(q_ptr + node * s_qn + heads[:, None] * s_qh + d[None, :], mask=hm[:, None] & dm[None, :], other=0.0).to(
            tl.float32
        )
        * scale
    )  # [GP, DP]
    m = tl.full([GP], -float("inf"), tl.float32)
    l = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)

    # 1. the context, block by block
    t = tl.arange(0, BP)
    for b in range(0, tl.cdiv(context_len, B)):
        blk = tl.load(table_ptr + b).to(tl.int64)
        valid = (t < B) & (b * B + t < context_len)
        kv_mask = valid[:, None] & dm[None, :]
        k = tl.load(kc_ptr + blk * s_kcn + t[:, None] * s_kcb + kvh * s_kch + d[None, :], mask=kv_mask, other=0.0).to(
            tl.float32
        )  # [BP, DP]
        v = tl.load(vc_ptr + blk * s_vcn + t[:, None] * s_vcb + kvh * s_vch + d[None, :], mask=kv_mask, other=0.0).to(
            tl.float32
        )
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GP, BP]
        s = tl.where(valid[None, :], s, -float("inf"))
        m, l, acc = _softmax_step(m, l, acc, s, v)

    # 2. the tree: tiles of W nodes masked by the ancestor bitmask's words
    j = tl.arange(0, W)
    for w in range(0, node // W + 1):
        word = tl.load(bits_ptr + node * n_words + w)
        idx = w * W + j
        anc = (((word >> j) & 1) != 0) & (idx < n_nodes)
        kv_mask = anc[:, None] & dm[None, :]
        k = tl.load(kt_ptr + idx[:, None] * s_ktn + kvh * s_kth + d[None, :], mask=kv_mask, other=0.0).to(
            tl.float32
        )  # [W, DP]
        v = tl.load(vt_ptr + idx[:, None] * s_vtn + kvh * s_vth + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GP, W]
        s = tl.where(anc[None, :], s, -float("inf"))
        m, l, acc = _softmax_step(m, l, acc, s, v)

    out = acc / l[:, None]  # l > 0: every node sees itself
    tl.store(
        out_ptr + node * s_on + heads[:, None] * s_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=hm[:, None] & dm[None, :],
    )


def pack_ancestor_bits(mask: torch.Tensor) -> torch.Tensor:
    """An ``[N, N]`` bool ancestor mask as ``[N, ceil(N / 32)]`` int32 words: bit ``j % 32`` of
    word ``j // 32`` of row ``i`` is ``mask[i, j]`` (bit 31 is the sign bit)."""
    n = mask.shape[0]
    words = -(-n // WORD)
    padded = torch.zeros(n, words * WORD, dtype=torch.int64, device=mask.device)
    padded[:, :n] = mask.to(torch.int64)
    shifts = torch.arange(WORD, dtype=torch.int64, device=mask.device)
    packed = (padded.view(n, words, WORD) << shifts).sum(-1)  # in [0, 2**32)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)  # two's complement
    return packed.to(torch.int32)


def tree_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    k_tree: torch.Tensor,
    v_tree: torch.Tensor,
    parents: torch.Tensor,
    scale: float,
    ancestor_bits: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`.reference.tree_attention` by the Triton kernel. ``ancestor_bits`` (from
    :func:`pack_ancestor_bits`) may be passed to reuse one step's bitmask across layers;
    without it the bitmask is built from ``parents``."""
    context_len = int(context_len)
    n, hq, hkv, d, bs = check_shapes(q, k_cache, v_cache, block_table, context_len, k_tree, v_tree, parents)
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("k_cache and v_cache need a unit stride along the head dimension")
    out = torch.empty_like(q)
    if n == 0:
        return out
    if ancestor_bits is None:
        ancestor_bits = pack_ancestor_bits(ancestor_mask(parents))
    words = -(-n // WORD)
    if tuple(ancestor_bits.shape) != (n, words) or ancestor_bits.dtype != torch.int32:
        raise ValueError(
            f"ancestor_bits must be int32 [N, ceil(N / 32)] = {(n, words)}, got "
            f"{ancestor_bits.dtype} {tuple(ancestor_bits.shape)}"
        )
    dev = q.device
    q = q.contiguous()
    k_tree, v_tree = k_tree.contiguous(), v_tree.contiguous()
    table = block_table.to(device=dev, dtype=torch.int32).contiguous()
    bits = ancestor_bits.to(dev).contiguous()
    group = hq // hkv
    _tree_attention_kernel[(n, hkv)](
        q,
        k_cache,
        v_cache,
        table,
        k_tree,
        v_tree,
        bits,
        out,
        context_len,
        n,
        words,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        k_tree.stride(0),
        k_tree.stride(1),
        v_tree.stride(0),
        v_tree.stride(1),
        out.stride(0),
        out.stride(1),
        float(scale),
        GROUP=group,
        GP=triton.next_power_of_2(group),
        B=bs,
        BP=triton.next_power_of_2(bs),
        D=d,
        DP=triton.next_power_of_2(d),
        W=WORD,
    )
    return out
