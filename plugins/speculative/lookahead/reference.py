"""Lookahead (trie) proposer: the CPU path (drafting is pure Python; no kernel)."""

from __future__ import annotations

import math
from typing import Any, Sequence

from ....hooks import Proposer

from .policy import Calibration, OwnContext, Progress, SharedOutputs, TokenTrie


#: the longest suffix matched in a request's own text (longer matches, e.g. copying, draft longer
#: with ``spec_factor``)
OWN_LONGEST = 32
#: the longest suffix matched in other requests' outputs (``calibrate``; the calibration's longest
#: kind is 16 tokens and more)
SHARED_LONGEST = 16


def _copy(token_ids: Sequence[int], at: int, n: int) -> list[int]:
    """``n`` tokens continuing the earlier occurrence that ends at ``at``: the tokens after it, and
    where they reach the end of the sequence, the drafts themselves (an overlapping copy, as LZ77
    copies: a sequence repeating with period ``len(token_ids) - 1 - at`` is drafted as repeating
    on, not cut at the period)."""
    out = list(token_ids[at + 1 : at + 1 + n])
    period = len(token_ids) - 1 - at
    while 0 < period and len(out) < n:
        out.append(out[len(out) - period])
    return out


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
        #: draft lengths from measured acceptance per kind of match (``calibrate: true``)
        self.calibration = Calibration(params.fixed_cost_tokens) if params.calibrate else None
        #: other requests' outputs, matched at once and copied at any length (``calibrate: true``)
        self.shared = SharedOutputs(params.max_nodes) if params.calibrate else None

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
        if self.calibration is not None:
            return own  # calibrated: other requests' outputs come from SharedOutputs, not the trie
        start, stop = self.progress.advance(request_id, len(token_ids) - self.trie.depth + 1)
        self.trie.insert_range(token_ids, start, stop)
        return own

    def _chain(self, request_id: str, token_ids: Sequence[int], n: int) -> list[int]:
        """The draft chain: the request's own text's continuation where its suffix matches
        there at least as long as in the trie, else the trie's. Calibrated: the own text's or,
        where other requests' outputs match longer, their voted continuation (no trie), at the
        length the calibration gives the kind of match."""
        p, cal = self.params, self.calibration
        own = self._insert(request_id, token_ids)
        if n <= 0:
            return []
        if cal is None:
            node, length = self.trie.match(token_ids, n, p.min_match)
            shared_length = 0
        else:  # calibrated: other requests' outputs from SharedOutputs (its index, no trie)
            node, length = None, 0
            assert self.shared is not None
            self.shared.update(request_id, token_ids)
            candidates, shared_length = self.shared.match(request_id, token_ids, SHARED_LONGEST, p.min_match)
        if own is not None:
            at, own_length = own.match(token_ids, max(self.trie.depth - 1, OWN_LONGEST), p.min_match)
            if own_length and own_length >= max(length, shared_length):
                self.own_drafts += 1
                m = self._cap(n, own_length)
                if cal is not None:
                    m = cal.length(request_id, Calibration.kind("own", own_length), m)
                return _copy(token_ids, at, m)
        if shared_length and shared_length >= length:
            m = self._cap(n, shared_length)
            if cal is not None:
                m = cal.length(request_id, Calibration.kind("shared", shared_length), m)
            return SharedOutputs.continuation(candidates, m, SharedOutputs.MIN_PROB)
        if node is None:
            if cal is not None:
                cal.release(request_id)
            return []
        return self.trie._follow(node, [], self._cap(n, length), p.min_prob)

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
        from .._tree import DraftTree, merge_chains

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
        tokens, parents = merge_chains([first, *others], limit)
        self.drafted += len(tokens)
        return tokens, parents

    def begin_step(self, num_requests: int, num_tokens: int = 0) -> None:
        if self.calibration is not None:
            self.calibration.batch = max(1, int(num_requests))
        return None

    def accepted(self, request_id: str, num_accepted: int, num_verified: int) -> None:
        if self.calibration is not None:
            self.calibration.observe(request_id, num_accepted, num_verified)

    def finish(self, request_id: str) -> None:
        if self.calibration is not None:
            self.calibration.release(request_id)
        if self.shared is not None:
            self.shared.finish(request_id)
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
            **(
                {
                    "acceptance_by_match": {
                        f"{src}:{m}": round(self.calibration.rate((src, m)), 3)
                        for src, m in sorted(self.calibration.stats)
                    }
                }
                if self.calibration is not None
                else {}
            ),
        }
