"""Hydragen in PyTorch: prefix attention with stacked queries, suffix attention, LSE merge.

Each part returns its un-normalised-free partial output ``o`` (softmax-weighted values over
the part's keys) and the log-sum-exp ``lse`` of its scores; two parts over disjoint key sets
merge exactly: ``lse = logaddexp(lse_a, lse_b)``, ``o = o_a e^(lse_a-lse) + o_b e^(lse_b-lse)``.
"""
from __future__ import annotations

import torch

from vllm_graft.hooks import AttentionLayer, AttentionMethod, PagedBatch, split_kv_cache

from .policy import StepPlan, group_rows


def merge(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor):
    """Exact merge of two partial attentions (``o`` [..., D] float32, ``lse`` [...])."""
    lse = torch.logaddexp(lse_a, lse_b)
    wa = torch.exp(lse_a - lse).nan_to_num(0.0).unsqueeze(-1)
    wb = torch.exp(lse_b - lse).nan_to_num(0.0).unsqueeze(-1)
    return o_a * wa + o_b * wb, lse


def _partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
             mask: torch.Tensor | None = None):
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


def prefix_attention(query: torch.Tensor, kv_cache: torch.Tensor, rows: torch.Tensor,
                     blocks: torch.Tensor, layer: AttentionLayer):
    """One group: the queries at token ``rows`` (all its sequences' new tokens) stacked
    against the group's blocks, read once. Returns ``o`` [R, H, D], ``lse`` [R, H] (float32)."""
    k_cache, v_cache = split_kv_cache(kv_cache)
    hkv, g = layer.num_kv_heads, layer.num_heads // layer.num_kv_heads
    r = rows.numel()
    q = query[rows.long()].float().view(r, hkv, g, -1).permute(1, 0, 2, 3).reshape(hkv, r * g, -1)
    o, lse = _partial(q, _blocks_kv(k_cache, blocks), _blocks_kv(v_cache, blocks), layer.scale)
    o = o.view(hkv, r, g, -1).permute(1, 0, 2, 3).reshape(r, hkv * g, -1)
    return o, lse.view(hkv, r, g).permute(1, 0, 2).reshape(r, hkv * g)


def suffix_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_row: torch.Tensor,
                     start_block: int, seq_len: int, layer: AttentionLayer):
    """One sequence: its new tokens ``query`` [q, H, D] against its own blocks from
    ``start_block`` to the end of its ``seq_len`` tokens, causally."""
    k_cache, v_cache = split_kv_cache(kv_cache)
    bs = kv_cache.shape[2]
    hkv, g = layer.num_kv_heads, layer.num_heads // layer.num_kv_heads
    nq = query.shape[0]
    blocks = block_row[start_block:-(-seq_len // bs)]
    first = start_block * bs
    n = seq_len - first
    k = _blocks_kv(k_cache, blocks)[:, :n]
    v = _blocks_kv(v_cache, blocks)[:, :n]
    q = query.float().view(nq, hkv, g, -1).permute(1, 0, 2, 3).reshape(hkv, nq * g, -1)
    dev = query.device
    q_pos = torch.arange(seq_len - nq, seq_len, device=dev).repeat_interleave(g)  # [nq * g]
    mask = (torch.arange(first, seq_len, device=dev).unsqueeze(0) > q_pos.unsqueeze(1))
    o, lse = _partial(q, k, v, layer.scale, mask)
    o = o.view(hkv, nq, g, -1).permute(1, 0, 2, 3).reshape(nq, hkv * g, -1)
    return o, lse.view(hkv, nq, g).permute(1, 0, 2).reshape(nq, hkv * g)


def hydragen_attention(query: torch.Tensor, kv_cache: torch.Tensor, batch: PagedBatch,
                       layer: AttentionLayer, plan: StepPlan) -> torch.Tensor:
    bs = kv_cache.shape[2]
    tree = plan.prefixes(bs)
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    lse = torch.full(query.shape[:2], float("-inf"), device=query.device)
    for i, n in enumerate(plan.seq_lens):
        q0, q1 = plan.query_start[i], plan.query_start[i + 1]
        if q1 == q0:
            continue
        out[q0:q1], lse[q0:q1] = suffix_attention(query[q0:q1], kv_cache, batch.block_table[i],
                                                  tree.suffix_start[i], n, layer)
    for grp in tree.groups:
        rows = torch.tensor(group_rows(plan, grp.seqs), dtype=torch.long, device=query.device)
        blocks = torch.tensor(grp.blocks, device=query.device)
        o, l = prefix_attention(query, kv_cache, rows, blocks, layer)
        out[rows], lse[rows] = merge(out[rows], lse[rows], o, l)
    return out.to(query.dtype)


class Hydragen(AttentionMethod):
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
        return hydragen_attention(query, kv_cache, batch, layer, plan)

    def describe(self):
        return {"steps": self.steps, "max_tree_depth": self.max_depth,
                "kv_tokens_read": self.kv_read, "kv_tokens_plain": self.kv_plain,
                "kv_read_ratio": round(self.kv_plain / self.kv_read, 3) if self.kv_read else None}
