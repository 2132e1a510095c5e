"""`hyperattention` in PyTorch (the reference and the CPU path).

Per sequence of a step:

* a decode token, or a prefill (chunk) whose context ``n`` (cached prefix plus the chunk) is shorter
  than ``min_seq_len``: exact causal attention (the attention kind's shared paged attention);
* otherwise the chunk's ``q`` queries (positions ``n - q .. n - 1``) attend
  (:func:`prefill_hyper`) to the prefix ``0 .. n - q - 1``, which they all see, by
  :func:`hyper_unmasked`, and to the chunk itself causally by :func:`hyper_causal`; the two
  partial results merge by log-sum-exp. A prompt prefilled in one step has no prefix: it is the
  paper's causal algorithm.

:func:`hyper_unmasked` (the paper's Algorithm 2 with sortLSH, no mask): queries and keys are hashed
by one angular LSH (:func:`lsh_rank`: the sign pattern of ``lsh_bits`` random projections, ranked
in Gray-code order so that adjacent buckets differ in one bit) and stably sorted by it, per head.
The sorted keys are cut into ``nb = ceil(n_k / block_size)`` blocks of (nearly) equal size and the
sorted queries into ``nb`` blocks by relative rank (:func:`partition`; equal sizes when ``n_q =
n_k``, as in the paper); each query block attends exactly to its key block. The remainder is
estimated from ``sample_size`` keys drawn uniformly without replacement per KV head: a sampled key
in the query's own block is masked out (it is counted exactly already), the others count
``n_k / m`` times (unbiased for the remainder's softmax numerator and denominator). With ``m >=
n_k`` every key is sampled once (weight 1): the result is exact.

:func:`hyper_causal` (the paper's Algorithm 3): a causal square of ``n`` tokens shorter than
``min_seq_len`` is exact; otherwise its queries are halved at ``h = n // 2``: the first half
recurses on the first half of the keys, the second half recurses on the second half and adds the
unmasked lower-left rectangle (queries ``h..n-1`` over keys ``0..h-1``) by :func:`hyper_unmasked`.

Causality: no query ever reads a later key (the rectangles hold only earlier keys; the leaves are
causal). As in the paper, a query's block holds the keys of the same *rank* range among the
rectangle's queries, so which earlier keys it attends to exactly depends on the other queries of
its rectangle, later ones included.

Differences from the paper: the blocks of a rectangle with ``n_q != n_k`` (a chunk over its prefix;
odd halves) pair the queries and keys by relative rank; the sampled keys are drawn without
replacement (so that a sample as large as the keys is exact); an odd causal square is split
unevenly instead of padded. Everything runs in float32 whatever the cache's dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ....hooks import AttentionLayer, AttentionMethod, PagedBatch
from .._shared import gather_kv, paged_attention


@dataclass
class Config:
    """What the algorithm reads from the parameters (so the functions need no plugin)."""

    min_seq_len: int = 4096
    block_size: int = 256
    sample_size: int = 256
    exact_kernel: bool = True


@dataclass
class Counter:
    """Query-key scores computed (one query head, one key), and what dense causal attention of
    the same rows would compute."""

    scores: int = 0
    dense: int = 0
    rects: int = 0  # unmasked rectangles approximated
    leaves: int = 0  # exact causal squares


# ---------------------------------------------------------------------------- the hash
def gray_rank(bits: torch.Tensor) -> torch.Tensor:
    """``bits [..., r]`` (bool) -> ``[...]`` int64: the position of the code (bit ``i`` of weight
    ``2**i``) in the reflected Gray sequence ``g(t) = t ^ (t >> 1)``, so that codes adjacent in
    this order differ in exactly one bit (sortLSH's Hamming-sorted buckets)."""
    r = bits.shape[-1]
    code = (bits.long() << torch.arange(r, device=bits.device)).sum(-1)
    rank, shift = code, 1
    while shift < r:  # the inverse Gray code: the xor of all right shifts
        rank = rank ^ (rank >> shift)
        shift <<= 1
    return rank


def lsh_rank(x: torch.Tensor, planes: torch.Tensor) -> torch.Tensor:
    """Angular LSH bucket of each row of ``x [..., n, D]`` under ``planes [D, r]``, as its
    Gray-code rank ``[..., n]``."""
    return gray_rank((x @ planes) > 0)


def hyperplanes(head_size: int, bits: int, seed: int, device: Any = None) -> torch.Tensor:
    """The LSH's random Gaussian projections ``[D, bits]`` (float32), from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(head_size, bits, generator=g).to(device)


def partition(n: int, nb: int, device: Any = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``n`` sorted rows into ``nb`` contiguous blocks of sizes differing by at most one (row ``p``
    in block ``p * nb // n``): ``(block [n], position in the block [n], widest block)``."""
    p = torch.arange(n, device=device)
    blk = p * nb // n
    start = (blk * n + nb - 1) // nb  # the first row of each block: ceil(blk * n / nb)
    return blk, p - start, -(-n // nb)


# ---------------------------------------------------------------------------- the pieces
def merge(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions over disjoint key sets, ``o [..., D]`` normalised with log-sum-exp
    ``l [...]`` (-inf: no key), merged exactly."""
    lse = torch.logaddexp(l1, l2)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    w1, w2 = (l1 - safe).exp(), (l2 - safe).exp()
    return o1 * w1[..., None] + o2 * w2[..., None], lse


def exact_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, fused: bool = True, rows: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact causal attention of a square: ``q [H, n, D]``, ``k``/``v [H_kv, n, D]`` (query ``i``
    sees keys ``0..i``) -> ``(out [H, n, D], lse [H, n])``, float32. ``fused``: PyTorch's fused
    CPU attention (which returns the log-sum-exp), where this PyTorch has it and the tensors are
    on the CPU; else explicit scores, ``rows`` queries at a time."""
    H, n, D = q.shape
    g = H // k.shape[0]
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if fused and op is not None and q.device.type == "cpu":
        kk, vv = (t.repeat_interleave(g, 0).unsqueeze(0) for t in (k, v))
        o, lse = op(q.unsqueeze(0).contiguous(), kk, vv, 0.0, True, scale=scale)
        return o[0], lse[0]
    out, lse = torch.empty_like(q), q.new_empty(H, n)
    qg = q.view(k.shape[0], g, n, D)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        s = torch.einsum("hgqd,hkd->hgqk", qg[:, :, r0:r1], k[:, :r1]) * scale
        future = torch.arange(r1, device=q.device)[None, :] > torch.arange(r0, r1, device=q.device)[:, None]
        s = s.masked_fill(future, float("-inf"))
        ls = s.logsumexp(-1)
        out[:, r0:r1] = torch.einsum("hgqk,hkd->hgqd", (s - ls[..., None]).exp(), v[:, :r1]).reshape(H, r1 - r0, D)
        lse[:, r0:r1] = ls.reshape(H, r1 - r0)
    return out, lse


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, masked: torch.Tensor | None, fused: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with its log-sum-exp: ``q [B, M, L, D]``, ``k``/``v [B, M, S, D]``, ``masked``
    (bool, True: left out) broadcastable to ``[B, M, L, S]`` -> ``(out [B, M, L, D], lse [B, M,
    L])``; a row with every key masked gets output 0 and lse -inf. ``fused``: PyTorch's fused CPU
    attention where it exists and the tensors are on the CPU, else explicit scores."""
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if fused and op is not None and q.device.type == "cpu":
        bias = None
        if masked is not None:
            bias = torch.zeros(masked.shape, dtype=q.dtype, device=q.device).masked_fill_(masked, float("-inf"))
        o, lse = op(q.contiguous(), k.contiguous(), v.contiguous(), 0.0, False, attn_mask=bias, scale=scale)
        if masked is not None:  # the fused op gives an empty row lse 0
            empty = masked.all(-1).expand(lse.shape)
            lse = lse.masked_fill(empty, float("-inf"))
            o = o.masked_fill(empty[..., None], 0.0)
        return o, lse
    s = (q @ k.transpose(-1, -2)) * scale
    if masked is not None:
        s = s.masked_fill(masked, float("-inf"))
    lse = s.logsumexp(-1)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return (s - safe[..., None]).exp() @ v, lse


def _rows(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``x [M, n, D]`` with each head's rows taken in ``order [M, r]`` -> ``[M, r, D]`` (one
    index_select of rows, faster than a gather along dim 1 on the CPU)."""
    M, n, D = x.shape
    flat = (order + torch.arange(M, device=x.device)[:, None] * n).reshape(-1)
    return x.reshape(M * n, D).index_select(0, flat).view(M, order.shape[1], D)


def _blocked(x: torch.Tensor, blk: torch.Tensor, pos: torch.Tensor, nb: int, width: int) -> torch.Tensor:
    """Sorted rows ``x [M, n, D]`` into blocks ``[M, nb, width, D]`` (zero padding)."""
    M, n, D = x.shape
    if n == nb * width:
        return x.view(M, nb, width, D)
    out = x.new_zeros(M, nb * width, D)
    return out.index_copy_(1, blk * width + pos, x).view(M, nb, width, D)


def hyper_unmasked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    planes: torch.Tensor,
    cfg: Config,
    gen: torch.Generator | None,
    count: Counter | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Approximate attention of every query over every key (no mask): ``q [H, n_q, D]``,
    ``k``/``v [H_kv, n_k, D]`` float32 -> ``(out [H, n_q, D], lse [H, n_q])`` (the log of the
    estimated softmax denominator). sortLSH blocks exact, plus the uniformly sampled remainder
    (see the module's docstring); ``gen`` draws the sample (CPU generator)."""
    H, nq, D = q.shape
    hkv, nk = k.shape[0], k.shape[1]
    g, dev = H // hkv, q.device
    nb = max(1, -(-nk // cfg.block_size))
    q_order = torch.argsort(lsh_rank(q, planes), dim=1, stable=True)  # [H, n_q]
    k_order = torch.argsort(lsh_rank(k, planes), dim=1, stable=True)  # [H_kv, n_k]
    qs, ks, vs = _rows(q, q_order), _rows(k, k_order), _rows(v, k_order)
    qblk, qpos, qw = partition(nq, nb, dev)
    kblk, kpos, kw = partition(nk, nb, dev)
    # block-diagonal part: query block b of the sorted order against key block b (blocks as heads)
    kp = _blocked(ks, kblk, kpos, nb, kw).repeat_interleave(g, 0)  # [H, nb, kw, D]
    vp = _blocked(vs, kblk, kpos, nb, kw).repeat_interleave(g, 0)
    pad = None
    if nk % nb:  # ragged blocks: the padding keys masked (every block holds at least one key)
        pad = torch.ones(nb, kw, dtype=torch.bool, device=dev)
        pad[kblk, kpos] = False
        pad = pad[None, :, None, :]
    o_b, lse_b = attend(_blocked(qs, qblk, qpos, nb, qw), kp, vp, scale, pad, cfg.exact_kernel)
    slot = qblk * qw + qpos
    o = o_b.reshape(H, nb * qw, D).index_select(1, slot)
    lse = lse_b.reshape(H, nb * qw).index_select(1, slot)
    m = min(cfg.sample_size, nk)
    if count is not None:
        count.scores += H * (nq * kw + nq * m)
        count.rects += 1
    if m > 0 and nb > 1:  # one block holds every key: nothing remains
        if m >= nk:
            idx = torch.arange(nk, device=dev).expand(hkv, nk)
        else:
            idx = torch.rand(hkv, nk, generator=gen).topk(m, dim=1).indices.to(dev)  # uniform, distinct
        k_s = _rows(ks, idx).repeat_interleave(g, 0)[:, None]  # [H, 1, m, D]
        v_s = _rows(vs, idx).repeat_interleave(g, 0)[:, None]
        same = qblk[None, :, None] == kblk[idx][:, None, :]  # [H_kv, n_q, m]: already counted exactly
        o2, l2 = attend(qs[:, None], k_s, v_s, scale, same.repeat_interleave(g, 0)[:, None], cfg.exact_kernel)
        o, lse = merge(o, lse, o2[:, 0], l2[:, 0] + math.log(nk / m))
    flat = (q_order + torch.arange(H, device=dev)[:, None] * nq).reshape(-1)  # back to the queries' order
    out = torch.empty(H * nq, D, dtype=o.dtype, device=dev).index_copy_(0, flat, o.reshape(H * nq, D))
    out_lse = torch.empty(H * nq, dtype=lse.dtype, device=dev).index_copy_(0, flat, lse.reshape(-1))
    return out.view(H, nq, D), out_lse.view(H, nq)


def hyper_causal(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    planes: torch.Tensor,
    cfg: Config,
    gen: torch.Generator | None,
    count: Counter | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Approximate causal attention of a square (query ``i`` over keys ``0..i``): ``q [H, n, D]``,
    ``k``/``v [H_kv, n, D]`` float32 -> ``(out, lse)``, by the paper's recursive halving (exact
    below ``min_seq_len``)."""
    n = q.shape[1]
    if n < cfg.min_seq_len or n < 2:
        if count is not None:
            count.scores += q.shape[0] * n * (n + 1) // 2
            count.leaves += 1
        return exact_causal(q, k, v, scale, cfg.exact_kernel)
    h = n // 2
    o1, l1 = hyper_causal(q[:, :h], k[:, :h], v[:, :h], scale, planes, cfg, gen, count)
    o2, l2 = hyper_causal(q[:, h:], k[:, h:], v[:, h:], scale, planes, cfg, gen, count)
    o3, l3 = hyper_unmasked(q[:, h:], k[:, :h], v[:, :h], scale, planes, cfg, gen, count)
    o2, l2 = merge(o2, l2, o3, l3)
    return torch.cat([o1, o2], 1), torch.cat([l1, l2], 1)


def prefill_hyper(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    planes: torch.Tensor,
    cfg: Config,
    gen: torch.Generator | None,
    count: Counter | None = None,
) -> torch.Tensor:
    """One sequence's prefill (chunk): ``q [n_q, H, D]``, the last ``n_q`` of the ``n`` positions
    of ``k``/``v [n, H_kv, D]`` -> ``[n_q, H, D]`` float32: the chunk over the prefix by
    :func:`hyper_unmasked`, over itself by :func:`hyper_causal`, merged."""
    nq, n = q.shape[0], k.shape[0]
    qh, kh, vh = (t.float().transpose(0, 1).contiguous() for t in (q, k, v))  # head-major
    p = n - nq
    o, lse = hyper_causal(qh, kh[:, p:], vh[:, p:], scale, planes, cfg, gen, count)
    if p > 0:
        o, lse = merge(o, lse, *hyper_unmasked(qh, kh[:, :p], vh[:, :p], scale, planes, cfg, gen, count))
    if count is not None:
        count.dense += q.shape[1] * (nq * p + nq * (nq + 1) // 2)
    return o.transpose(0, 1)


def sample_generator(seed: int, layer_index: int, n: int, nq: int) -> torch.Generator:
    """The generator of one sequence's samples at one layer: a function of the seed, the layer
    and the chunk's place in the sequence only (not of the batch it came in)."""
    return torch.Generator().manual_seed((seed * 1_000_003 + (layer_index + 1) * 65_537 + n * 257 + nq) % (1 << 62))


# ---------------------------------------------------------------------------- the plugin
@dataclass
class StepPlan:
    """Which sequences of a step are approximated, and the batch the others are attended in."""

    long: list[tuple[int, int, int, int]]  # (sequence, first query row, end row, context length)
    rest: PagedBatch
    exact_rows: int


class HyperAttention(AttentionMethod):
    kv_layouts = ("blocked", "packed")  # every read goes through layer.kv_layout.split

    def __init__(self, params) -> None:
        super().__init__(params)
        self._planes: dict[tuple[int, int, str], torch.Tensor] = {}
        self.count = Counter()
        self.approx_rows = 0  # prefill query rows (x layers) attended approximately
        self.exact_rows = 0  # query rows (x layers) attended exactly
        self.chunks_with_prefix = 0  # approximated chunks that had a cached prefix (chunked prefill)

    def config(self) -> Config:
        p = self.params
        return Config(p.min_seq_len, p.block_size, p.sample_size, p.exact_kernel)

    def planes(self, layer: AttentionLayer, device: Any) -> torch.Tensor:
        key = (layer.index, layer.head_size, str(device))
        if key not in self._planes:
            seed = self.params.seed * 1_000_003 + 7919 * (layer.index + 1)
            self._planes[key] = hyperplanes(layer.head_size, self.params.lsh_bits, seed, device)
        return self._planes[key]

    def plan(self, batch: PagedBatch) -> StepPlan | None:
        """The step's long prefills (read on the host once per step); None for a step of decodes."""
        if batch.max_query_len == 1:
            return None
        qsl, lens = batch.query_start_loc.tolist(), batch.seq_lens.tolist()
        long, exact_rows = [], 0
        for i, n in enumerate(lens):
            q0, q1 = qsl[i], qsl[i + 1]
            if q1 - q0 > 1 and n >= self.params.min_seq_len:
                long.append((i, q0, q1, n))
            elif q1 > q0 and n > 0:
                exact_rows += q1 - q0
        if not long:
            return StepPlan([], batch, exact_rows)
        rest_lens = batch.seq_lens.clone()
        rest_lens[[i for i, *_ in long]] = 0  # the exact path skips a sequence of no tokens
        rest = PagedBatch(batch.query_start_loc, rest_lens, batch.block_table, batch.max_query_len)
        return StepPlan(long, rest, exact_rows)

    def forward(self, query, kv_cache, batch, layer, plan=None):
        if plan is None:
            plan = self.plan(batch)
        if plan is None:  # decodes only: exact, no host sync (rows counted as the query's, padding included)
            self.exact_rows += query.shape[0]
            return paged_attention(query, kv_cache, batch, layer)
        self.exact_rows += plan.exact_rows
        if not plan.long:
            return paged_attention(query, kv_cache, batch, layer)
        out = paged_attention(query, kv_cache, plan.rest, layer)
        bs = kv_cache.shape[2]
        cfg, planes = self.config(), self.planes(layer, query.device)
        for i, q0, q1, n in plan.long:
            k, v = gather_kv(kv_cache, batch.block_table[i, : -(-n // bs)], n, layer.head_size, layer.kv_layout)
            gen = sample_generator(self.params.seed, layer.index, n, q1 - q0)
            o = prefill_hyper(query[q0:q1], k, v, layer.scale, planes, cfg, gen, self.count)
            out[q0:q1] = o.to(query.dtype)
            self.approx_rows += q1 - q0
            self.chunks_with_prefix += int(n > q1 - q0)
        return out

    def describe(self) -> dict[str, Any]:
        c = self.count
        return {
            "approx_rows": self.approx_rows,
            "exact_rows": self.exact_rows,
            "chunks_with_prefix": self.chunks_with_prefix,
            "rectangles_approximated": c.rects,
            "exact_leaves": c.leaves,
            "scores_computed": c.scores,
            "scores_dense": c.dense,
            "score_fraction": round(c.scores / c.dense, 4) if c.dense else None,
        }
