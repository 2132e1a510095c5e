"""Lookahead (trie) proposer: the CPU path (drafting is pure Python; no kernel)."""
from __future__ import annotations

from typing import Any, Sequence

from vllm_graft.hooks import Proposer

from .policy import Progress, TokenTrie


class TrieLookahead(Proposer):
    """One trie of token windows from every request's prompt and output (see ``policy``)."""

    def __init__(self, params: Any) -> None:
        super().__init__(params)
        self.trie = TokenTrie(params.depth, params.max_nodes, params.prune_to)
        self.progress = Progress()
        self.proposed = self.drafted = 0

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        start, stop = self.progress.advance(request_id, len(token_ids) - self.trie.depth + 1)
        self.trie.insert_range(token_ids, start, stop)
        n = min(max_tokens, self.params.num_speculative_tokens)
        drafts = self.trie.continuation(token_ids, n, self.params.min_match)
        self.proposed += 1
        self.drafted += len(drafts)
        return drafts

    def finish(self, request_id: str) -> None:
        self.progress.release(request_id)

    def describe(self) -> dict[str, Any]:
        return {"trie_nodes": self.trie.num_nodes, "max_nodes": self.trie.max_nodes,
                "prunes": self.trie.prunes, "live_requests": len(self.progress),
                "proposals": self.proposed, "drafted": self.drafted}
