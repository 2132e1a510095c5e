"""Pooled n-gram proposer (CPU path; drafting is pure Python)."""

from __future__ import annotations

from typing import Any, Sequence

from ....hooks import Proposer

from .policy import PoolStore


class PooledNgram(Proposer):
    def __init__(self, params: Any) -> None:
        super().__init__(params)
        self.store = PoolStore(
            prefix_tokens=params.prefix_tokens,
            max_order=params.max_order,
            max_contexts=params.max_contexts,
            max_pools=params.max_pools,
            include_prompt=params.include_prompt,
        )
        self.proposed = self.drafted = 0

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        pool = self.store.observe(request_id, token_ids)
        n = min(max_tokens, self.params.num_speculative_tokens)
        drafts = pool.draft(token_ids, n, self.params.min_order)
        self.proposed += 1
        self.drafted += len(drafts)
        return drafts

    def finish(self, request_id: str) -> None:
        self.store.release(request_id)

    def describe(self) -> dict[str, Any]:
        return {
            "pools": len(self.store.pools),
            "contexts": self.store.num_contexts,
            "live_requests": len(self.store.requests),
            "proposals": self.proposed,
            "drafted": self.drafted,
        }
