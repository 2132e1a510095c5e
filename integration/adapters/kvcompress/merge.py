"""Merge-on-evict (a ``merges`` compressor, e.g. ``d2o``) in the worker, vLLM-free.

A scored compressor decides in the worker, after the step's forward pass, which blocks each
request drops (:meth:`.scores._Scores.finalize`); the scheduler frees them only when the step's
output reaches it. In between their KV is still in the cache, so a merging compressor's worker
state (:class:`MergingScores`) reads, per request and per layer, the newly dropped blocks' and
the kept blocks' K/V through the route's layout (``KVCacheLayout.split``), hands them to the
compressor's :meth:`~vllm_graft.hooks.KVCompressor.merge` and writes the kept tokens' new K/V
back in place, before the drops go out on the step's output. The step's per-layer caches and
block table are noted by the attention seam (:class:`MergingAttention`) as the layers run.

Everything stays on the cache's device: the block ids come from the step's block table (a
device tensor) through host-built column indices moved once per request; no value is read back.
A merged block's content no longer matches its tokens' prefix-cache hash, so the adapter salts
each request of a merging compressor on its own (``Active.salt_per_request``).
"""

from __future__ import annotations

from typing import Any

from .scores import _Scores, _ScoringAttention, _StepPlan


class MergingScores(_Scores):
    """:class:`._Scores` plus the merge of each step's drops (see the module doc)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: the step's caches as the layers ran: data pointer -> (kv_cache, kv_layout)
        self.caches: dict[int, tuple[Any, Any]] = {}
        self.block_table: Any = None
        #: per request, per cache (data pointer): the compressor's merge state
        self.merge_state: dict[str, dict[int, Any]] = {}

    def forget(self, req_ids: Any) -> None:
        super().forget(req_ids)
        for r in req_ids or ():
            self.merge_state.pop(r, None)

    def skip(self, req_id: str, computed: int, block_size: int) -> list[int]:
        if computed <= 0:  # computed from scratch again: its merged state went with its blocks
            self.merge_state.pop(req_id, None)
        return super().skip(req_id, computed, block_size)

    def plan(self, batch: Any) -> _StepPlan | None:
        self.caches, self.block_table = {}, batch.block_table
        return super().plan(batch)

    def note(self, kv_cache: Any, layout: Any) -> None:
        """The attention seam ran a layer over ``kv_cache`` (in ``layout``)."""
        self.caches.setdefault(kv_cache.data_ptr(), (kv_cache, layout))

    def finalize(self) -> dict[str, list[int]]:
        plan = self.pending
        drops = super().finalize()
        if drops and plan is not None and self.caches and self.block_table is not None:
            for i, row in enumerate(plan.rows):
                new = drops.get(row[0])
                if new:
                    self._merge_row(plan, i, new)
            self.count("blocks_merged", sum(len(b) for b in drops.values()))
        self.caches, self.block_table = {}, None
        return drops

    def _merge_row(self, plan: _StepPlan, i: int, new: list[int]) -> None:
        import torch

        req_id, computed, q = plan.rows[i][:3]
        B, total = plan.block_size, computed + q
        dropped = self.reqs[req_id].dropped  # now including ``new``
        column = {logical: j for j, logical in enumerate(plan.cols[i])}
        kept = [logical for logical in plan.cols[i] if logical not in dropped]
        if not kept:
            return
        # the last kept block is the one being written: its slots past the last token are empty
        valid = (len(kept) - 1) * B + (total - kept[-1] * B)
        # built on the host from the plan's Python lists, moved once (as the plan's own indices)
        cols = torch.tensor([column[b] for b in sorted(new)] + [column[b] for b in kept], dtype=torch.long)
        row = self.block_table[i]
        phys = row.index_select(0, cols.to(row.device, non_blocking=True)).long()
        gone, held = phys[: len(new)], phys[len(new) :]
        states = self.merge_state.setdefault(req_id, {})
        for ptr, (kv_cache, layout) in self.caches.items():
            k_cache, v_cache = layout.split(kv_cache)  # [N, H_kv, B, D]
            H, D = k_cache.shape[1], k_cache.shape[3]

            def tokens(cache: Any, blocks: Any) -> Any:  # [n, H, B, D] -> [H, n*B, D]
                return cache.index_select(0, blocks).permute(1, 0, 2, 3).reshape(H, -1, D)

            kept_k, kept_v = tokens(k_cache, held), tokens(v_cache, held)
            new_k, new_v, states[ptr] = self.compressor.merge(
                tokens(k_cache, gone),
                tokens(v_cache, gone),
                kept_k[:, :valid],
                kept_v[:, :valid],
                states.get(ptr),
            )
            for cache, full, merged in ((k_cache, kept_k, new_k), (v_cache, kept_v, new_v)):
                full[:, :valid] = merged.to(full.dtype)
                cache[held] = full.reshape(H, len(kept), B, D).permute(1, 0, 2, 3)


class MergingAttention(_ScoringAttention):
    """The scoring attention, noting each layer's cache for the step's merge. No step is handed
    to vLLM's own kernel (``plain``): the merge needs every layer's cache noted, and a step that
    drops blocks may be one that observes nothing (a compressor with a scoring window)."""

    def plain(self, plan: Any) -> bool:
        return False

    def mass_only(self, plan: Any) -> bool:
        return False

    def forward(self, query, kv_cache, batch, layer, plan=None):
        if plan is not None and isinstance(self.scores, MergingScores):
            self.scores.note(kv_cache, layer.kv_layout)
        return super().forward(query, kv_cache, batch, layer, plan)
