"""Lookahead (trie) proposer: the CPU path (drafting is pure Python; no kernel)."""

from __future__ import annotations

import math
from typing import Any, Sequence

from vllm_graft.hooks import Proposer

from .policy import OwnContext, Progress, TokenTrie


#: the longest suffix matched in a request's own text (longer matches, e.g. copying, draft longer
#: with ``spec_factor``)
OWN_LONGEST = 32


class TrieLookahead(Proposer):
    """One trie of token windows shared by every request (see ``policy``). With
    ``shared_prompts: false`` (the default) a request's prompt is matched in an index of its own
    (:class:`~.policy.OwnContext`, with its output) and only the windows from its first draft
    on go into the trie; with ``true`` every window of every prompt is inserted too."""

    def __init__(self, params: Any) -> None:
        super().__init__(params)
        self.trie = TokenTrie(params.depth, params.max_nodes, params.prune_to)
        self.progress = Progress()
        self.own: dict[str, OwnContext] = {}
        self.shared_prompts = bool(params.shared_prompts)
        self.proposed = self.drafted = self.own_drafts = 0
        self.drafts_trees = bool(getattr(params, "tree", False))  # tree mode (propose_tree)

    def _insert(self, request_id: str, token_ids: Sequence[int]) -> OwnContext | None:
        """Bring the trie (and the request's own index) up to ``token_ids``."""
        own = None
        if not self.shared_prompts:
            own = self.own.get(request_id)
            if own is None:
                own = self.own[request_id] = OwnContext()
                # the trie starts at the first window that reaches the last token seen now
                self.progress.advance(request_id, max(0, len(token_ids) - self.trie.depth))
            own.update(token_ids)
        start, stop = self.progress.advance(request_id, len(token_ids) - self.trie.depth + 1)
        self.trie.insert_range(token_ids, start, stop)
        return own

    def _chain(self, request_id: str, token_ids: Sequence[int], n: int) -> list[int]:
        """The draft chain: the request's own text's continuation where its suffix matches
        there at least as long as in the trie, else the trie's."""
        p = self.params
        own = self._insert(request_id, token_ids)
        if n <= 0:
            return []
        node, length = self.trie.match(token_ids, n, p.min_match)
        if own is not None:
            at, own_length = own.match(token_ids, max(self.trie.depth - 1, OWN_LONGEST), p.min_match)
            if own_length and own_length >= length:
                self.own_drafts += 1
                return list(token_ids[at + 1 : at + 1 + self._cap(n, own_length)])
        return [] if node is None else self.trie._follow(node, [], self._cap(n, length), p.min_prob)

    def _cap(self, n: int, matched: int) -> int:
        """The draft length after a match of ``matched`` tokens (``spec_factor``)."""
        f = self.params.spec_factor
        return n if f <= 0.0 else min(n, math.ceil(f * matched))

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        drafts = self._chain(request_id, token_ids, min(max_tokens, self.params.num_speculative_tokens))
        self.proposed += 1
        self.drafted += len(drafts)
        return drafts

    def propose_tree(self, request_id: str, token_ids: Sequence[int], max_nodes: int) -> tuple[list[int], list[int]]:
        from .._tree import DraftTree

        p = self.params
        self.proposed += 1
        limit = min(max_nodes, p.num_speculative_tokens)
        first = self._chain(request_id, token_ids, p.tree_depth)  # the chain, as the first branch
        if p.min_prob > 0.0:
            tokens, parents = self.trie.likely_tree(token_ids, limit, p.tree_depth, p.min_prob, p.min_match)
            trie_tree = DraftTree(tokens, parents) if tokens else None
            others = [[tokens[i] for i in path] for path in trie_tree.paths()] if trie_tree is not None else []
        else:
            others = self.trie.branches(token_ids, p.tree_depth, p.tree_branches, p.min_match)
        tree = DraftTree.from_chains([first, *others])
        n = min(len(tree), limit)
        self.drafted += n
        return tree.tokens[:n].tolist(), tree.parents[:n].tolist()

    def finish(self, request_id: str) -> None:
        self.progress.release(request_id)
        self.own.pop(request_id, None)

    def describe(self) -> dict[str, Any]:
        return {
            "trie_nodes": self.trie.num_nodes,
            "max_nodes": self.trie.max_nodes,
            "prunes": self.trie.prunes,
            "live_requests": len(self.progress),
            "proposals": self.proposed,
            "drafted": self.drafted,
            "own_context_drafts": self.own_drafts,
        }
