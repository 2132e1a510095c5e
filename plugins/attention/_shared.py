"""Exact causal attention over a paged KV cache, in PyTorch (slow, exact): the one
implementation that the attention plugins (``noop``, ``squeezed``'s prefill rows), the scored KV
compressors (``h2o``/``snapkv``'s attention with mass, ``kv4``'s prefill rows and its attention
with mass) and the graft attention backend (when no attention plugin is enabled) all call.

* :func:`gather_kv`: one sequence's keys and values ``[seq_len, H_kv, D]`` from the cache
  (:func:`flat_blocks` for blocks read otherwise, e.g. dequantised);
* :func:`head_major_kv`: many blocks' keys and values ``[..., H_kv, nb*B, D]`` in one gather;
* :func:`cache_strides`: the (block, head, token) strides of split K and V views for a kernel;
* :func:`causal_attention`: the last ``len(q)`` positions of a context attending causally
  (GQA: query head ``h`` reads KV head ``h // (H / H_kv)``), in float32;
* :func:`paged_attention` / :func:`paged_attention_with_mass`: every sequence of a
  :class:`~vllm_graft.hooks.PagedBatch`; the latter also returns the softmax probability the
  observed queries put on each block (``KVCompressor.attend``);
* :class:`PagedAttention`: the same as an ``AttentionMethod`` (the ``noop`` plugin's).
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch

from ...hooks import BLOCKED, AttentionLayer, AttentionMethod, KVCacheLayout, PagedBatch

#: ``gather(block_ids)``: the keys and values ``[nb, H_kv, B, D]`` each of those blocks
Gather = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _cache_gather(kv_cache: torch.Tensor, layout: KVCacheLayout = BLOCKED) -> Gather:
    """Blocks read through ``layout.split`` (any layout, any strides)."""
    k_cache, v_cache = layout.split(kv_cache)  # [N, H_kv, B, D] each

    def gather(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return k_cache.index_select(0, ids), v_cache.index_select(0, ids)

    return gather


def cache_strides(k_cache: torch.Tensor, v_cache: torch.Tensor, who: str) -> tuple[int, ...]:
    """The first three strides of K, then of V (block, head, token of the ``[N, H_kv, B, D]`` views
    the attention kernels read; block, token, head of the tree kernel's ``[N, B, H_kv, D]``);
    ``ValueError`` unless both have a unit stride along ``D``."""
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError(
            f"{who}: the key and value caches need a unit stride along the head dimension, got "
            f"K strides {tuple(k_cache.stride())}, V strides {tuple(v_cache.stride())}; pass "
            "the views layer.kv_layout.split(kv_cache) gives of a cache whose last dim is "
            "contiguous"
        )
    return (
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
    )


def cache_rows(block_ids: torch.Tensor, hkv: int) -> torch.Tensor:
    """Rows of a blocked cache viewed ``[N * H_kv, 2, B, D]`` for ``block_ids [..., nb]``, in
    ``[..., H_kv, nb]`` order (the argument :func:`head_major_kv` takes for the blocked layout)."""
    heads = torch.arange(hkv, device=block_ids.device)
    return (block_ids.long().unsqueeze(-2) * hkv + heads[:, None]).reshape(-1)


def head_major_kv(
    kv_cache: torch.Tensor, layout: KVCacheLayout, block_ids: torch.Tensor, rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V ``[*lead, H_kv, nb*B, D]`` of the blocks ``block_ids [*lead, nb]`` (int), in the
    cache's dtype. Blocked layout (per block and KV head, ``B`` keys then ``B`` values): one
    index_select of whole ``[2, B, D]`` chunks straight into head-major order, at ``rows``
    (:func:`cache_rows` of ``block_ids``, built here when not given); any other layout: one
    index_select per split view, then a copy into head-major order. No host sync."""
    N, hkv, B, C = kv_cache.shape
    D = C // 2
    lead, nb = tuple(block_ids.shape[:-1]), block_ids.shape[-1]
    if layout.name == BLOCKED.name:
        if rows is None:
            rows = cache_rows(block_ids, hkv)
        kv = kv_cache.reshape(N * hkv, 2, B, D).index_select(0, rows).view(*lead, hkv, nb, 2, B, D)
        return (kv.select(-3, 0).reshape(*lead, hkv, nb * B, D), kv.select(-3, 1).reshape(*lead, hkv, nb * B, D))
    ids = block_ids.reshape(-1).long()
    return tuple(
        c.index_select(0, ids).view(*lead, nb, hkv, B, D).transpose(-4, -3).reshape(*lead, hkv, nb * B, D)
        for c in layout.split(kv_cache)
    )


def flat_blocks(blocks: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[nb, H_kv, B, D]`` -> the first ``seq_len`` tokens ``[seq_len, H_kv, D]``."""
    return blocks.permute(0, 2, 1, 3).reshape(-1, blocks.shape[1], blocks.shape[3])[:seq_len]


def gather_kv(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int, head_size: int, layout: KVCacheLayout = BLOCKED
):
    """K, V ``[seq_len, H_kv, D]`` of one sequence from ``kv_cache [N, H_kv, B, 2D]`` in
    ``layout`` (a plugin passes ``layer.kv_layout``)."""
    k, v = _cache_gather(kv_cache, layout)(block_ids.long())
    return flat_blocks(k, seq_len), flat_blocks(v, seq_len)


def causal_probs(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    positions: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax probabilities ``[H, q, n]`` (float32) of the queries ``q [q, H, D]`` over their
    causal context ``k [n, H_kv, D]``; the queries are the last ``len(q)`` positions, or at
    ``positions`` (absolute, ``[q]``). ``key_mask [H_kv, n]`` (bool): the keys each KV head
    may read besides causality (False: left out for that head's group of query heads)."""
    nq, h, _ = q.shape
    n, hkv = k.shape[0], k.shape[1]
    kk = k.float().repeat_interleave(h // hkv, dim=1)  # [n, H, D]
    s = torch.einsum("qhd,khd->hqk", q.float(), kk) * scale
    if positions is None:
        positions = torch.arange(n - nq, n, device=q.device)
    q_pos = positions.to(q.device).unsqueeze(1)  # absolute positions of the queries
    s = s.masked_fill(torch.arange(n, device=q.device).unsqueeze(0) > q_pos, float("-inf"))  # future keys
    if key_mask is not None:
        s = s.masked_fill(~key_mask.to(torch.bool).repeat_interleave(h // hkv, dim=0)[:, None, :], float("-inf"))
    return s.softmax(-1)


def fused_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`causal_attention` through PyTorch's fused attention (no ``[H, q, n]`` probabilities
    in memory): ``[q, H, D]`` float32, equal to it to float rounding."""
    nq, h, _ = q.shape
    n, hkv = k.shape[0], k.shape[1]
    qh, kh, vh = (t.float().transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, len, D]
    if nq == n:
        o = torch.nn.functional.scaled_dot_product_attention(
            qh, kh, vh, is_causal=True, scale=scale, enable_gqa=hkv != h
        )
    else:
        allowed = torch.arange(n, device=q.device)[None, :] <= torch.arange(n - nq, n, device=q.device)[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=allowed, scale=scale, enable_gqa=hkv != h
        )
    return o[0].transpose(0, 1)


def attend_probs(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Output ``[q, H, D]`` (float32) of probabilities ``p [H, q, n]`` over values ``v [n, H_kv, D]``."""
    vv = v.float().repeat_interleave(p.shape[0] // v.shape[1], dim=1)
    return torch.einsum("hqk,khd->qhd", p, vv)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Full causal attention of the last ``len(q)`` positions: ``q [q, H, D]``, ``k``/``v``
    ``[n, H_kv, D]`` -> ``[q, H, D]`` float32."""
    return attend_probs(causal_probs(q, k, scale), v)


#: Largest padded score tensor (sequences x heads x queries x keys) computed in one batched
#: call; a larger step (long prefill chunks) goes sequence by sequence.
BATCHED_SCORES_MAX = 1 << 24


class _StepIndex:
    """The batched path's indices for one step: the same for every layer of the step, so they
    are built once per ``PagedBatch`` (see :func:`_step_index`)."""

    def __init__(self, batch: PagedBatch, block_size: int, num_rows: int) -> None:
        qsl, lens = batch.query_start_loc.long(), batch.seq_lens.long()
        dev = qsl.device
        self.S = S = lens.numel()
        qlen = (qsl[1:] - qsl[:-1]).clamp_min(0)
        qlen = torch.where(lens > 0, qlen, torch.zeros_like(qlen))
        self.maxq = int(qlen.max()) if S else 0
        maxl = int(lens.max()) if S else 0
        self.nb = -(-maxl // block_size) if maxl > 0 else 0
        self.L = self.nb * block_size
        if self.maxq == 0 or self.nb == 0:
            return
        j = torch.arange(self.maxq, device=dev)
        self.q_ok = j[None, :] < qlen[:, None]  # [S, maxq]
        self.rows = (qsl[:-1, None] + j[None, :]).clamp(0, max(num_rows - 1, 0))
        # the padded outputs' real rows, as an index (read per layer without a host sync), and
        # the query rows they are (one nonzero per step: the mask is read once)
        self.q_ok_flat = self.q_ok.reshape(-1).nonzero().squeeze(1)
        self.out_rows = self.rows.reshape(-1).index_select(0, self.q_ok_flat)
        q_pos = (lens - qlen)[:, None] + j[None, :]  # absolute position of each query
        k_pos = torch.arange(self.L, device=dev)
        allowed = (k_pos[None, None, :] <= q_pos[:, :, None]) & self.q_ok[:, :, None]  # causal
        allowed[:, :, 0] |= ~self.q_ok  # padding queries see key 0 only: no empty row, no NaN
        self.allowed = allowed
        self.table = batch.block_table[:, : self.nb].long()
        self._cache_rows: dict[int, torch.Tensor] = {}

    def cache_rows(self, hkv: int) -> torch.Tensor:
        """Rows of the cache viewed ``[N * H_kv, 2, B, D]``, in ``[S, H_kv, nb]`` order."""
        if hkv not in self._cache_rows:
            self._cache_rows[hkv] = cache_rows(self.table, hkv)
        return self._cache_rows[hkv]


_last_index: tuple = (None, None, None)  # (weakref to the batch, key, _StepIndex)


def _version(t: torch.Tensor) -> int:
    """A tensor's in-place version counter; -1 for an inference tensor (vLLM's forward runs under
    ``torch.inference_mode``), which has none: the batch's tensors are not changed in place
    between the layers of a step, and a new tensor has a new identity."""
    return -1 if t.is_inference() else t._version


def _step_index(batch: PagedBatch, block_size: int, num_rows: int) -> _StepIndex:
    """The step's :class:`_StepIndex`, built at its first layer and reused by the others (the
    key holds the batch's tensors and their version counters: a batch whose tensors are
    replaced or changed in place is indexed again)."""
    global _last_index
    key = (block_size, num_rows) + tuple(
        (id(t), _version(t)) for t in (batch.query_start_loc, batch.seq_lens, batch.block_table)
    )
    ref, last_key, index = _last_index
    if ref is not None and ref() is batch and last_key == key:
        return index
    index = _StepIndex(batch, block_size, num_rows)
    _last_index = (weakref.ref(batch), key, index)
    return index


def _padded_kv(
    kv_cache: torch.Tensor, index: _StepIndex, gather: Gather | None, layout: KVCacheLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V ``[S, H_kv, nb*B, D]`` of the step's blocks. From the cache itself in ``layout``
    (:func:`head_major_kv`: for the blocked layout one index_select of whole ``[2, B, D]``
    chunks); through ``gather`` (e.g. a storage format's dequantisation), a gather and a copy."""
    S, nb = index.S, index.nb
    if gather is None:
        rows = index.cache_rows(kv_cache.shape[1]) if layout.name == BLOCKED.name else None
        return head_major_kv(kv_cache, layout, index.table, rows)
    k, v = gather(index.table.reshape(-1))  # [S*nb, H_kv, B, D]
    _, hkv, B, D = k.shape
    return tuple(t.view(S, nb, hkv, B, D).permute(0, 2, 1, 3, 4).reshape(S, hkv, nb * B, D) for t in (k, v))


def _paged_batched(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: PagedBatch,
    layer: AttentionLayer,
    observe: torch.Tensor | None,
    gather: Gather | None,
    head_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """:func:`_paged` for the whole batch at once, without a Python loop over sequences: every
    sequence's blocks gathered into one padded ``[S, H_kv, L, D]``, queries padded to the
    longest, one masked attention (fused, or with explicit probabilities when ``observe`` asks
    for the block mass). None when the padded scores would exceed :data:`BATCHED_SCORES_MAX`."""
    T, H, D = query.shape
    B, dev = kv_cache.shape[2], query.device
    ix = _step_index(batch, B, T)
    hkv = layer.num_kv_heads
    out = torch.zeros(query.shape, dtype=query.dtype, device=dev)
    mass = (
        None
        if observe is None
        else torch.zeros(
            (ix.S, hkv, batch.block_table.shape[1]) if head_mask is not None else (ix.S, batch.block_table.shape[1]),
            dtype=torch.float32,
            device=dev,
        )
    )
    if ix.maxq == 0 or ix.nb == 0:
        return out, mass
    if ix.S * H * ix.maxq * ix.L > BATCHED_SCORES_MAX:
        return None
    if observe is not None and observe.device.type == "cpu" and not bool(observe[:T].any()):
        observe = None  # nothing observed: no mass to compute (asked on the host only: a sync per layer on a GPU)
    k, v = _padded_kv(kv_cache, ix, gather, layer.kv_layout)
    k, v = k.float(), v.float()
    q = query[ix.rows].float().permute(0, 2, 1, 3)  # [S, H, maxq, D]
    g = H // hkv
    allowed = ix.allowed[:, None]  # [S, 1, maxq, L]
    if head_mask is not None:  # per KV head: the blocks it reads, for its group of query heads
        keys = head_mask[:, :, : ix.nb].to(torch.bool).repeat_interleave(g, 1).repeat_interleave(B, -1)
        allowed = allowed & keys[:, :, None, :]  # [S, H, maxq, L]
        allowed[:, :, :, 0] |= ~ix.q_ok[:, None, :]  # padding queries: key 0, no empty row
    if observe is None:
        o = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, scale=layer.scale, enable_gqa=hkv != H
        )
    else:
        assert mass is not None  # allocated when observe was given
        s = torch.einsum("shqd,shkd->shqk", q, k.repeat_interleave(g, dim=1)) * layer.scale
        p = s.masked_fill(~allowed, float("-inf")).softmax(-1)
        o = torch.einsum("shqk,shkd->shqd", p, v.repeat_interleave(g, dim=1))
        w = (observe.to(torch.float32)[ix.rows] * ix.q_ok).to(p.dtype)  # [S, maxq]
        if head_mask is not None:  # per KV head: summed over its group's query heads
            per_key = torch.einsum("shqk,sq->shk", p, w)
            mass[:, :, : ix.nb] = per_key.view(ix.S, hkv, g, ix.nb, B).sum((2, 4))
        else:
            per_key = torch.einsum("shqk,sq->sk", p, w)
            mass[:, : ix.nb] = per_key.view(ix.S, ix.nb, B).sum(-1)
    o = o.permute(0, 2, 1, 3).reshape(ix.S * ix.maxq, H, -1).index_select(0, ix.q_ok_flat)
    out[ix.out_rows] = o.to(query.dtype)
    return out, mass


def _paged(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: PagedBatch,
    layer: AttentionLayer,
    observe: torch.Tensor | None,
    gather: Gather | None,
    head_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every sequence of ``batch``: ``(out [T, H, D], mass [num_seqs, max_blocks] or None)``;
    with ``head_mask [num_seqs, H_kv, max_blocks]`` each KV head reads only its blocks and the
    mass is per KV head, ``[num_seqs, H_kv, max_blocks]``."""
    B = kv_cache.shape[2]
    done = _paged_batched(query, kv_cache, batch, layer, observe, gather, head_mask)
    if done is not None:
        return done
    gather = gather or _cache_gather(kv_cache, layer.kv_layout)
    qsl = batch.query_start_loc.tolist()
    lens = batch.seq_lens.tolist()
    out = torch.zeros(query.shape, dtype=query.dtype, device=query.device)
    hkv = layer.num_kv_heads
    mass = (
        None
        if observe is None
        else torch.zeros(
            (len(lens), hkv, batch.block_table.shape[1])
            if head_mask is not None
            else (len(lens), batch.block_table.shape[1]),
            dtype=torch.float32,
            device=query.device,
        )
    )
    for i, L in enumerate(lens):
        q0, q1 = qsl[i], qsl[i + 1]
        if q1 <= q0 or L <= 0:
            continue
        nb = -(-L // B)
        k, v = gather(batch.block_table[i, :nb].long())
        k, v = flat_blocks(k, L), flat_blocks(v, L)
        if head_mask is not None:  # explicit probabilities, each head masked to its blocks
            keys = head_mask[i, :, :nb].to(torch.bool).repeat_interleave(B, -1)[:, :L]  # [H_kv, L]
            p = causal_probs(query[q0:q1], k, layer.scale, key_mask=keys)  # [H, q, L]
            out[q0:q1] = attend_probs(p, v).to(query.dtype)
            if mass is not None and observe is not None:  # mass is allocated iff observe is given
                w = observe[q0:q1].to(torch.float32)
                per_key = torch.nn.functional.pad(torch.einsum("hqk,q->hk", p, w), (0, nb * B - L))
                mass[i, :, :nb] = per_key.view(hkv, -1, nb, B).sum((1, 3))
            continue
        # a long chunk: the output by fused attention; explicit probabilities only for the
        # observed queries (e.g. SnapKV's window: the last few of a prompt), whose mass counts
        out[q0:q1] = fused_causal_attention(query[q0:q1], k, v, layer.scale).to(query.dtype)
        if mass is not None and observe is not None:
            rows = observe[q0:q1].nonzero().squeeze(1)
            if rows.numel():
                p = causal_probs(query[q0:q1][rows], k, layer.scale, positions=L - (q1 - q0) + rows)
                padded = torch.zeros(nb * B, dtype=torch.float32, device=query.device)
                padded[:L] = p.sum((0, 1))
                mass[i, :nb] = padded.view(nb, B).sum(-1)
    return out, mass


def paged_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, batch: PagedBatch, layer: AttentionLayer, gather: Gather | None = None
) -> torch.Tensor:
    """Causal attention ``[T, H, D]`` of ``query [T, H, D]`` over the paged cache.

    Sequence i's queries are rows ``query_start_loc[i]:query_start_loc[i+1]``, the last ``q``
    of its ``seq_lens[i]`` positions; its keys are the first ``seq_lens[i]`` slots of the
    blocks ``block_table[i]``. Computed in float32. ``gather(block_ids)`` gives those blocks'
    keys and values ``[nb, H_kv, B, D]`` each (default: read through ``layer.kv_layout.split``;
    a storage format such as ``kv4`` passes its dequantisation)."""
    return _paged(query, kv_cache, batch, layer, None, gather)[0]


def paged_attention_with_mass(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: PagedBatch,
    layer: AttentionLayer,
    observe: torch.Tensor,
    gather: Gather | None = None,
    head_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`paged_attention` and ``mass [num_seqs, max_blocks]`` (see ``KVCompressor.attend``):
    the softmax probability the observed queries (``observe [T]`` bool) put on each
    block-table column, summed over heads and those queries. With ``head_mask [num_seqs,
    H_kv, max_blocks]`` (bool; a per-head compressor's), KV head h of sequence i reads only the
    columns where it is True (its group of query heads, ``h * H / H_kv`` onwards), and the
    mass is per KV head, ``[num_seqs, H_kv, max_blocks]`` (summed over that group)."""
    out, mass = _paged(query, kv_cache, batch, layer, observe, gather, head_mask)
    assert mass is not None
    return out, mass


class PagedAttention(AttentionMethod):
    """Exact causal attention over the paged KV cache (the ``noop`` attention plugin; the graft
    backend's attention when no attention plugin is enabled)."""

    kv_layouts = ("blocked", "packed")  # reads through layer.kv_layout.split

    def forward(self, query, kv_cache, batch, layer, plan=None):
        return paged_attention(query, kv_cache, batch, layer)
