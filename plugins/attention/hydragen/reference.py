"""Hydragen in PyTorch: prefix attention with stacked queries, suffix attention, LSE merge.

:func:`hydragen_attention` is the readable form (a loop over sequences and groups; the oracle);
:func:`hydragen_attention_batched` is the CPU path: the same parts, every short sequence's
suffix in one padded call and each group in one call, through PyTorch's CPU flash attention
(which returns the log-sum-exp the merge needs), with the step's indices built once per step.

Each part returns its un-normalised-free partial output ``o`` (softmax-weighted values over
the part's keys) and the log-sum-exp ``lse`` of its scores; two parts over disjoint key sets
merge exactly: ``lse = logaddexp(lse_a, lse_b)``, ``o = o_a e^(lse_a-lse) + o_b e^(lse_b-lse)``.
"""

from __future__ import annotations

import torch

from ....hooks import AttentionLayer, AttentionMethod, PagedBatch

from .._shared import cache_rows as _cache_rows
from .._shared import head_major_kv

from .policy import StepPlan, group_rows


def merge(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor):
    """Exact merge of two partial attentions (``o`` [..., D] float32, ``lse`` [...])."""
    lse = torch.logaddexp(lse_a, lse_b)
    wa = torch.exp(lse_a - lse).nan_to_num(0.0).unsqueeze(-1)
    wb = torch.exp(lse_b - lse).nan_to_num(0.0).unsqueeze(-1)
    return o_a * wa + o_b * wb, lse


def _partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None = None):
    """``q`` [Hkv, M, D], ``k``/``v`` [Hkv, L, D] (float32); ``mask`` [M, L] True = hidden.
    Returns ``o`` [Hkv, M, D] and ``lse`` [Hkv, M]."""
    s = torch.einsum("hmd,hld->hml", q, k) * scale
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    return torch.einsum("hml,hld->hmd", p, v), lse


def _blocks_kv(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``cache`` [N, Hkv, B, D] at ``blocks`` -> [Hkv, len(blocks) * B, D] float32."""
    x = cache[blocks.long()]  # [nb, Hkv, B, D]
    return x.permute(1, 0, 2, 3).reshape(x.shape[1], -1, x.shape[3]).float()


def prefix_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, rows: torch.Tensor, blocks: torch.Tensor, layer: AttentionLayer
):
    """One group: the queries at token ``rows`` (all its sequences' new tokens) stacked
    against the group's blocks, read once. Returns ``o`` [R, H, D], ``lse`` [R, H] (float32)."""
    k_cache, v_cache = layer.kv_layout.split(kv_cache)
    hkv, g = layer.num_kv_heads, layer.num_heads // layer.num_kv_heads
    r = rows.numel()
    q = query[rows.long()].float().view(r, hkv, g, -1).permute(1, 0, 2, 3).reshape(hkv, r * g, -1)
    o, lse = _partial(q, _blocks_kv(k_cache, blocks), _blocks_kv(v_cache, blocks), layer.scale)
    o = o.view(hkv, r, g, -1).permute(1, 0, 2, 3).reshape(r, hkv * g, -1)
    return o, lse.view(hkv, r, g).permute(1, 0, 2).reshape(r, hkv * g)


def suffix_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_row: torch.Tensor,
    start_block: int,
    seq_len: int,
    layer: AttentionLayer,
):
    """One sequence: its new tokens ``query`` [q, H, D] against its own blocks from
    ``start_block`` to the end of its ``seq_len`` tokens, causally."""
    k_cache, v_cache = layer.kv_layout.split(kv_cache)
    bs = kv_cache.shape[2]
    hkv, g = layer.num_kv_heads, layer.num_heads // layer.num_kv_heads
    nq = query.shape[0]
    blocks = block_row[start_block : -(-seq_len // bs)]
    first = start_block * bs
    n = seq_len - first
    k = _blocks_kv(k_cache, blocks)[:, :n]
    v = _blocks_kv(v_cache, blocks)[:, :n]
    q = query.float().view(nq, hkv, g, -1).permute(1, 0, 2, 3).reshape(hkv, nq * g, -1)
    dev = query.device
    q_pos = torch.arange(seq_len - nq, seq_len, device=dev).repeat_interleave(g)  # [nq * g]
    mask = torch.arange(first, seq_len, device=dev).unsqueeze(0) > q_pos.unsqueeze(1)
    o, lse = _partial(q, k, v, layer.scale, mask)
    o = o.view(hkv, nq, g, -1).permute(1, 0, 2, 3).reshape(nq, hkv * g, -1)
    return o, lse.view(hkv, nq, g).permute(1, 0, 2).reshape(nq, hkv * g)


def hydragen_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, batch: PagedBatch, layer: AttentionLayer, plan: StepPlan
) -> torch.Tensor:
    bs = kv_cache.shape[2]
    tree = plan.prefixes(bs)
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    lse = torch.full(query.shape[:2], float("-inf"), device=query.device)
    for i, n in enumerate(plan.seq_lens):
        q0, q1 = plan.query_start[i], plan.query_start[i + 1]
        if q1 == q0:
            continue
        out[q0:q1], lse[q0:q1] = suffix_attention(
            query[q0:q1], kv_cache, batch.block_table[i], tree.suffix_start[i], n, layer
        )
    for grp in tree.groups:
        rows = torch.tensor(group_rows(plan, grp.seqs), dtype=torch.long, device=query.device)
        blocks = torch.tensor(grp.blocks, device=query.device)
        o, l = prefix_attention(query, kv_cache, rows, blocks, layer)
        out[rows], lse[rows] = merge(out[rows], lse[rows], o, l)
    return out.to(query.dtype)


# ---------------------------------------------------------------- the batched CPU path
#: Sequences with at most this many new tokens (decode, speculative verification) share one
#: padded suffix call; longer ones (prefill chunks) get a call each (:class:`_LongCall`), so no
#: sequence is padded to a prefill chunk's length.
SHORT_QUERIES = 16
#: Largest additive mask (sequences x query rows x keys) one batched suffix call builds; a
#: larger step attends its short sequences one by one as well.
SUFFIX_MASK_MAX = 1 << 24


def _flash(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused attention with its log-sum-exp (PyTorch's CPU flash attention): ``q`` [S, h, M, D],
    ``k``/``v`` [S, h, L, D] float32, ``mask`` additive [S, 1, M, L] or None, ``causal`` (top-left
    aligned, for M == L). Returns ``o`` [S, h, M, D] and ``lse`` [S, h, M] (natural log)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)


def _gather(kv_cache: torch.Tensor, layer: AttentionLayer, blocks: torch.Tensor, rows: torch.Tensor):
    """K, V ``[*lead, Hkv, nb * B, D]`` float32 of ``blocks [*lead, nb]`` in ``layer.kv_layout``
    (``rows``: :func:`_cache_rows` of them, the blocked layout's one index_select)."""
    k, v = head_major_kv(kv_cache, layer.kv_layout, blocks, rows)
    return k.float(), v.float()


class _SuffixCall:
    """One padded suffix call's indices (the same for every layer of a step): sequences
    ``seqs``, their query rows padded to ``m`` and their suffix blocks padded to ``nb``."""

    def __init__(
        self, plan: StepPlan, tree, table: torch.Tensor, seqs: list[int], hkv: int, g: int, device: torch.device
    ) -> None:
        bs = tree.block_size
        self.S, self.g = len(seqs), g
        starts = [tree.suffix_start[i] for i in seqs]
        ends = [-(-plan.seq_lens[i] // bs) for i in seqs]
        self.nb = max(e - s for s, e in zip(starts, ends))
        self.m = max(plan.q_lens[i] for i in seqs)
        cols = torch.tensor(starts, device=device)[:, None] + torch.arange(self.nb, device=device)
        ok_cols = cols < torch.tensor(ends, device=device)[:, None]
        seq_t = torch.tensor(seqs, device=device)
        self.blocks = torch.where(
            ok_cols, table[seq_t[:, None], cols.clamp_max(table.shape[1] - 1)], torch.zeros_like(cols)
        ).long()  # [S, nb]; padding reads block 0
        j = torch.arange(self.m, device=device)
        qlen = torch.tensor([plan.q_lens[i] for i in seqs], device=device)
        self.q_ok = j[None, :] < qlen[:, None]  # [S, m]
        qstart = torch.tensor([plan.query_start[i] for i in seqs], device=device)
        self.rows = (qstart[:, None] + j[None, :]).masked_fill(~self.q_ok, 0)  # [S, m] token rows
        lens = torch.tensor([plan.seq_lens[i] for i in seqs], device=device)
        first = torch.tensor(starts, device=device) * bs  # absolute position of the first key
        q_pos = (lens - qlen)[:, None] + j[None, :]  # [S, m]
        k_pos = first[:, None] + torch.arange(self.nb * bs, device=device)[None, :]  # [S, L]
        allowed = (k_pos[:, None, :] <= q_pos[:, :, None]) & self.q_ok[:, :, None]  # causal, in range
        allowed[:, :, 0] |= ~self.q_ok  # a padding query sees one key: no empty row, no NaN
        allowed = allowed.repeat_interleave(g, dim=1)  # query rows are (token, head-in-group)
        self.mask = torch.zeros(allowed.shape, device=device).masked_fill_(~allowed, float("-inf"))[:, None]
        self.cache_rows = _cache_rows(self.blocks, hkv)

    def run(self, query, kv_cache, layer, out, lse) -> None:
        hkv, g, S, m = layer.num_kv_heads, self.g, self.S, self.m
        k, v = _gather(kv_cache, layer, self.blocks, self.cache_rows)
        d = query.shape[-1]
        q = query[self.rows].float().view(S, m, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(S, hkv, m * g, d)
        o, l = _flash(q, k, v, layer.scale, self.mask)
        o = o.view(S, hkv, m, g, d).permute(0, 2, 1, 3, 4).reshape(S, m, hkv * g, d)
        l = l.view(S, hkv, m, g).permute(0, 2, 1, 3).reshape(S, m, hkv * g)
        rows = self.rows[self.q_ok]
        out[rows], lse[rows] = o[self.q_ok], l[self.q_ok]


class _LongCall:
    """One sequence with many new tokens (a prefill chunk): its query heads attend its suffix
    in one fused call, K/V repeated to the query heads (no padding, no ``g``-fold mask); where
    the suffix is exactly its new tokens (a first chunk) the call is causal without a mask."""

    def __init__(self, plan: StepPlan, tree, table: torch.Tensor, i: int, hkv: int, device) -> None:
        bs = tree.block_size
        start, end = tree.suffix_start[i], -(-plan.seq_lens[i] // bs)
        self.nb = end - start
        self.blocks = table[i, start:end].long()
        self.n = plan.seq_lens[i] - start * bs  # suffix keys
        self.q0, self.m = plan.query_start[i], plan.q_lens[i]
        self.causal = self.n == self.m
        self.mask = None
        if not self.causal:
            q_pos = torch.arange(self.n - self.m, self.n, device=device)
            hidden = torch.arange(self.n, device=device)[None, :] > q_pos[:, None]
            self.mask = torch.zeros(hidden.shape, device=device).masked_fill_(hidden, float("-inf"))[None, None]
        self.cache_rows = _cache_rows(self.blocks, hkv)

    def run(self, query, kv_cache, layer, out, lse) -> None:
        hkv, h = layer.num_kv_heads, layer.num_heads
        k, v = _gather(kv_cache, layer, self.blocks[None], self.cache_rows)
        k = k[:, :, : self.n].repeat_interleave(h // hkv, dim=1)
        v = v[:, :, : self.n].repeat_interleave(h // hkv, dim=1)
        rows = slice(self.q0, self.q0 + self.m)
        q = query[rows].float().transpose(0, 1)[None]  # [1, H, m, D]
        o, l = _flash(q, k, v, layer.scale, self.mask, self.causal)
        out[rows], lse[rows] = o[0].transpose(0, 1), l[0].transpose(0, 1)


class _StepIndex:
    """A step's batched-path indices for one block size and head layout (kept in the plan's
    ``cache``, reused by every layer)."""

    def __init__(self, plan: StepPlan, table: torch.Tensor, bs: int, hkv: int, g: int, device) -> None:
        tree = plan.prefixes(bs)
        active = [i for i, q in enumerate(plan.q_lens) if q > 0]
        short = [i for i in active if plan.q_lens[i] <= SHORT_QUERIES]
        self.calls: list = [
            _LongCall(plan, tree, table, i, hkv, device) for i in active if plan.q_lens[i] > SHORT_QUERIES
        ]
        if short:
            width = max(-(-plan.seq_lens[i] // bs) - tree.suffix_start[i] for i in short) * bs
            m = max(plan.q_lens[i] for i in short)
            calls = [short] if len(short) * m * g * width <= SUFFIX_MASK_MAX else [[i] for i in short]
            self.calls += [_SuffixCall(plan, tree, table, seqs, hkv, g, device) for seqs in calls]
        #: per prefix group: its queries' token rows, its blocks [1, nb], their cache rows
        self.groups = []
        for grp in tree.groups:
            blocks = torch.tensor([grp.blocks], dtype=torch.long, device=device)
            self.groups.append(
                (
                    torch.tensor(group_rows(plan, grp.seqs), dtype=torch.long, device=device),
                    blocks,
                    _cache_rows(blocks, hkv),
                )
            )


def hydragen_attention_batched(
    query: torch.Tensor, kv_cache: torch.Tensor, batch: PagedBatch, layer: AttentionLayer, plan: StepPlan
) -> torch.Tensor:
    """:func:`hydragen_attention` without a Python loop over sequences, on the CPU: every short
    sequence's suffix in one padded fused attention, each prefix group in one fused attention
    (PyTorch's CPU flash attention, which returns the log-sum-exp), merged as there."""
    bs, hkv = kv_cache.shape[2], layer.num_kv_heads
    g = layer.num_heads // hkv
    key = ("batched", bs, hkv, g)
    index = plan.cache.get(key)
    if index is None:
        index = plan.cache[key] = _StepIndex(plan, batch.block_table, bs, hkv, g, query.device)
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    lse = torch.full(query.shape[:2], float("-inf"), device=query.device)
    for call in index.calls:
        call.run(query, kv_cache, layer, out, lse)
    d = query.shape[-1]
    for rows, blocks, cache_rows in index.groups:
        r = rows.numel()
        k, v = _gather(kv_cache, layer, blocks, cache_rows)
        q = query[rows].float().view(r, hkv, g, d).permute(1, 0, 2, 3).reshape(1, hkv, r * g, d)
        o, l = _flash(q, k, v, layer.scale)
        o = o.view(hkv, r, g, d).permute(1, 0, 2, 3).reshape(r, hkv * g, d)
        l = l.view(hkv, r, g).permute(1, 0, 2).reshape(r, hkv * g)
        out[rows], lse[rows] = merge(out[rows], lse[rows], o, l)
    return out.to(query.dtype)


class Hydragen(AttentionMethod):
    kv_layouts = ("blocked", "packed")  # reference and kernel read through layer.kv_layout.split

    def __init__(self, params) -> None:
        super().__init__(params)
        self.steps = 0
        self.shared_tokens = 0  # tokens of group blocks summed over steps (first layer's view)
        self.max_depth = 0
        self.kv_plain = 0  # KV tokens plain attention would read, summed over steps
        self.kv_read = 0  # KV tokens Hydragen reads

    def plan(self, batch: PagedBatch) -> StepPlan:
        self.steps += 1
        return StepPlan(batch, self.params.min_group, self.params.min_blocks)

    def _record(self, plan: StepPlan, block_size: int) -> None:
        if plan.cache.get("recorded"):
            return
        plan.cache["recorded"] = True
        tree = plan.prefixes(block_size)
        self.max_depth = max(self.max_depth, tree.depth)
        shared = sum(len(g.blocks) for g in tree.groups) * block_size
        self.shared_tokens += shared
        active = [i for i, q in enumerate(plan.q_lens) if q > 0]
        self.kv_plain += sum(plan.seq_lens[i] for i in active)
        self.kv_read += shared + sum(plan.seq_lens[i] - tree.suffix_start[i] * block_size for i in active)

    def forward(self, query, kv_cache, batch, layer, plan=None):
        if plan is None:
            plan = self.plan(batch)
        self._record(plan, kv_cache.shape[2])
        if self.params.kernel == "triton":
            from .kernel import hydragen_attention_triton

            return hydragen_attention_triton(query, kv_cache, batch, layer, plan)
        if query.device.type == "cpu":
            return hydragen_attention_batched(query, kv_cache, batch, layer, plan)
        return hydragen_attention(query, kv_cache, batch, layer, plan)

    def describe(self):
        return {
            "steps": self.steps,
            "max_tree_depth": self.max_depth,
            "kv_tokens_read": self.kv_read,
            "kv_tokens_plain": self.kv_plain,
            "kv_read_ratio": round(self.kv_plain / self.kv_read, 3) if self.kv_read else None,
        }
