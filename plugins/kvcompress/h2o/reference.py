"""H2O at block granularity (Zhang et al. 2023, arXiv:2306.14048): keep sink blocks, the
recent window and the "heavy hitter" blocks with the most accumulated attention, at most
``budget_blocks`` in all.

:func:`paged_attention_with_mass` is the oracle of the Triton kernel (:mod:`.kernel`) and
the CPU path: plain causal attention over a paged cache that also returns how much softmax
probability the observed queries put on each block.
"""
from __future__ import annotations

from typing import Callable

import torch

from vllm_graft.hooks import AttentionLayer, BlockView, KVCompressor, PagedBatch, split_kv_cache

from ..streaming.policy import sink_window, top_blocks, with_pinned


def paged_attention_with_mass(query: torch.Tensor, kv_cache: torch.Tensor, batch: PagedBatch,
                              layer: AttentionLayer, observe: torch.Tensor,
                              gather: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, H, D], mass [num_seqs, max_blocks])`` (see ``KVCompressor.attend``).

    Sequence i's queries are rows ``query_start_loc[i]:query_start_loc[i+1]``, the last
    ``q`` of its ``seq_lens[i]`` positions; its keys are the first ``seq_lens[i]`` slots of
    the blocks ``block_table[i]``. Computed in fp32. ``gather(block_ids)`` gives those
    blocks' keys and values ``[nb, H_kv, B, D]`` each (default: read from the layout of
    ``split_kv_cache``; a storage format such as ``kv4`` passes its dequantisation)."""
    T, H, D = query.shape
    _, Hkv, B, _ = kv_cache.shape
    group = H // Hkv
    if gather is None:
        k_cache, v_cache = split_kv_cache(kv_cache)

        def gather(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return k_cache[ids], v_cache[ids]
    qsl = batch.query_start_loc.tolist()
    lens = batch.seq_lens.tolist()
    n = len(lens)
    out = torch.zeros(T, H, D, dtype=query.dtype, device=query.device)
    mass = torch.zeros(n, batch.block_table.shape[1], dtype=torch.float32, device=query.device)
    for i in range(n):
        q0, q1 = qsl[i], qsl[i + 1]
        L = lens[i]
        if q1 <= q0 or L <= 0:
            continue
        nb = -(-L // B)
        k, v = gather(batch.block_table[i, :nb].long())
        k = k.permute(1, 0, 2, 3).reshape(Hkv, nb * B, D)[:, :L].float()
        v = v.permute(1, 0, 2, 3).reshape(Hkv, nb * B, D)[:, :L].float()
        k = k.repeat_interleave(group, dim=0)  # [H, L, D]
        v = v.repeat_interleave(group, dim=0)
        q = query[q0:q1].float().transpose(0, 1)  # [H, q, D]
        s = torch.einsum("hqd,hkd->hqk", q, k) * layer.scale
        pos = torch.arange(L - (q1 - q0), L, device=query.device)
        s = s.masked_fill(torch.arange(L, device=query.device)[None, None, :] > pos[None, :, None], float("-inf"))
        p = torch.softmax(s, dim=-1)
        out[q0:q1] = torch.einsum("hqk,hkd->hqd", p, v).transpose(0, 1).to(out.dtype)
        obs = observe[q0:q1].to(p.dtype)
        per_key = torch.einsum("hqk,q->k", p, obs)
        padded = torch.zeros(nb * B, dtype=torch.float32, device=query.device)
        padded[:L] = per_key
        mass[i, :nb] = padded.view(nb, B).sum(-1)
    return out, mass


class H2O(KVCompressor):
    needs_scores = True

    def keep(self, view: BlockView) -> list[int]:
        p = self.params
        n = view.num_blocks
        if n <= p.budget_blocks or view.scores is None:
            return list(range(n))  # within budget (or asked without scores): drop nothing
        fixed = sink_window(n, p.sink_blocks, p.recent_blocks)
        scores = view.scores
        if p.score == "mean":  # per query that could attend to the block (from its first token on)
            scores = [s / max(1, view.num_tokens - i * view.block_size) for i, s in enumerate(scores)]
        heavy = top_blocks(scores, [i for i in range(n) if i not in fixed and scores[i] != float("-inf")],
                           p.budget_blocks - len(fixed))
        return with_pinned(fixed | heavy, view.pinned)

    def attend(self, query, kv_cache, batch, layer, observe):
        if self.params.kernel == "triton":
            from .kernel import attention_with_mass

            return attention_with_mass(query, kv_cache, batch, layer, observe)
        return paged_attention_with_mass(query, kv_cache, batch, layer, observe)

    def describe(self):
        return self.params.model_dump()
