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
        self.drafts_trees = bool(getattr(params, "tree", False))  # tree mode (propose_tree)

    def _insert(self, request_id: str, token_ids: Sequence[int]) -> None:
        start, stop = self.progress.advance(request_id, len(token_ids) - self.trie.depth + 1)
        self.trie.insert_range(token_ids, start, stop)

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        self._insert(request_id, token_ids)
        n = min(max_tokens, self.params.num_speculative_tokens)
        drafts = self.trie.continuation(token_ids, n, self.params.min_match)
        self.proposed += 1
        self.drafted += len(drafts)
        return drafts

    def propose_tree(self, request_id: str, token_ids: Sequence[int], max_nodes: int) -> tuple[list[int], list[int]]:
        from .._tree import DraftTree

        self._insert(request_id, token_ids)
        p = self.params
        tree = DraftTree.from_chains(self.trie.branches(token_ids, p.tree_depth, p.tree_branches, p.min_match))
        self.proposed += 1
        n = min(len(tree), max_nodes)
        self.drafted += n
        return tree.tokens[:n].tolist(), tree.parents[:n].tolist()

    def finish(self, request_id: str) -> None:
        self.progress.release(request_id)

    def describe(self) -> dict[str, Any]:
        return {
            "trie_nodes": self.trie.num_nodes,
            "max_nodes": self.trie.max_nodes,
            "prunes": self.trie.prunes,
            "live_requests": len(self.progress),
            "proposals": self.proposed,
            "drafted": self.drafted,
        }
