"""Trie-based lookahead drafting (after Fu et al., "Break the Sequential Dependency of LLM
Inference Using Lookahead Decoding", and the trie retrieval of Zhao et al., "Lookahead: An
Inference Acceleration Framework for LLM with Lossless Generation Accuracy", KDD 2024), as
pure Python.

Every window of ``depth`` consecutive tokens of prompts and generated outputs is inserted
from the root of one trie shared by all requests; each node counts how often its path was
inserted. So a path's count never exceeds its parent's. To draft, the longest suffix of the
sequence found as a path from the root with a child (at most ``depth - max_tokens``
tokens, so that a window has room for the drafts) is followed by its most frequent
children.

Memory: the trie holds at most ``max_nodes`` nodes. When an insertion goes over, every
count is halved (integer division) and nodes whose count reaches 0 are dropped with their
subtrees, repeatedly, until the trie is at most ``prune_to`` of the cap: frequent paths
survive, rare ones go (frequency pruning with ageing).
"""

from __future__ import annotations

import heapq
from typing import Sequence


class _Node:
    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


class TokenTrie:
    def __init__(self, depth: int, max_nodes: int, prune_to: float = 0.75) -> None:
        if depth < 2:
            raise ValueError(f"depth must be at least 2, got {depth}")
        if max_nodes < depth:
            raise ValueError(f"max_nodes must be at least depth ({depth}), got {max_nodes}")
        if not 0.0 < prune_to < 1.0:
            raise ValueError(f"prune_to must be in (0, 1), got {prune_to}")
        self.depth, self.max_nodes, self.prune_to = depth, max_nodes, prune_to
        self.root = _Node()
        self.num_nodes = 0  # excluding the root
        self.prunes = 0

    # ------------------------------------------------------------------ building
    def insert(self, window: Sequence[int]) -> None:
        """Count the path ``window`` (at most ``depth`` tokens) from the root."""
        node = self.root
        for t in window[: self.depth]:
            child = node.children.get(t)
            if child is None:
                child = node.children[t] = _Node()
                self.num_nodes += 1
            child.count += 1
            node = child
        if self.num_nodes > self.max_nodes:
            self.prune()

    def insert_range(self, tokens: Sequence[int], start: int, stop: int) -> None:
        """Insert the windows of ``tokens`` beginning at ``start, ..., stop - 1``."""
        for p in range(start, stop):
            self.insert(tokens[p : p + self.depth])

    def prune(self) -> None:
        """Halve every count and drop nodes at 0 until within ``prune_to * max_nodes``."""
        target = int(self.prune_to * self.max_nodes)
        while self.num_nodes > target:
            self.num_nodes -= self._halve(self.root)
            self.prunes += 1

    def _halve(self, node: _Node) -> int:
        """Halve counts below ``node``; return how many nodes were removed."""
        removed = 0
        stack = [node]
        while stack:
            n = stack.pop()
            dead = []
            for t, c in n.children.items():
                c.count //= 2
                if c.count == 0:
                    dead.append(t)
                else:
                    stack.append(c)
            for t in dead:
                removed += _size(n.children.pop(t))
        return removed

    # ------------------------------------------------------------------ drafting
    def _find(self, path: Sequence[int]) -> _Node | None:
        node = self.root
        for t in path:
            node = node.children.get(t)  # type: ignore[assignment]
            if node is None:
                return None
        return node

    def match(self, tokens: Sequence[int], max_tokens: int, min_match: int = 1) -> tuple[_Node | None, int]:
        """``(node, length)``: the node of the longest suffix of ``tokens`` that the trie holds
        with a child and that suffix's length, or ``(None, 0)``."""
        longest = min(len(tokens), self.depth - 1, max(min_match, self.depth - max_tokens))
        for s in range(longest, max(min_match, 1) - 1, -1):
            node = self._find(tokens[len(tokens) - s :])
            if node is not None and node.children:
                return node, s
        return None, 0

    @staticmethod
    def _follow(node: _Node, out: list[int], max_tokens: int, min_prob: float = 0.0) -> list[int]:
        """Extend ``out`` (the path to ``node``) by the most frequent child (ties: lower token
        id) at each level, up to ``max_tokens`` tokens, while the continuation's estimated
        probability (the product of each step's ``count / children's total``) is at least
        ``min_prob``."""
        prob = 1.0
        while node.children and len(out) < max_tokens:
            t, child = max(node.children.items(), key=lambda kv: (kv[1].count, -kv[0]))
            if min_prob > 0.0:
                prob *= child.count / sum(c.count for c in node.children.values())
                if prob < min_prob:
                    break
            out.append(t)
            node = child
        return out

    def continuation(
        self, tokens: Sequence[int], max_tokens: int, min_match: int = 1, min_prob: float = 0.0
    ) -> list[int]:
        """Most frequent continuation of the longest suffix of ``tokens`` that the trie
        holds with a child. Suffixes are tried from ``depth - max_tokens`` tokens (so that a
        match leaves room for ``max_tokens`` drafts in a window), but at least
        ``min_match``, down to ``min_match``. With ``min_prob`` the continuation stops before
        the first token at which its estimated probability falls below it (see :meth:`_follow`)."""
        node, _ = self.match(tokens, max_tokens, min_match)
        return [] if node is None or max_tokens <= 0 else self._follow(node, [], max_tokens, min_prob)

    def likely_tree(
        self, tokens: Sequence[int], max_nodes: int, max_depth: int, min_prob: float, min_match: int = 1
    ) -> tuple[list[int], list[int]]:
        """A draft tree of the likeliest continuations of the suffix :meth:`continuation`
        matches, as ``(tokens, parents)`` (parents first; -1: a child of the root): nodes are
        taken best first by their estimated path probability (the product of ``count /
        children's total`` along the path; ties: the shallower, then the lower token id) while it is at least
        ``min_prob``, up to ``max_nodes`` nodes and ``max_depth`` levels. Where one
        continuation dominates the tree is a chain; it branches only where the trie is unsure
        (the greedy tree of SuffixDecoding, Oliaro et al., arXiv:2411.04975)."""
        node, _ = self.match(tokens, max_depth, min_match)
        out_tokens: list[int] = []
        parents: list[int] = []
        if node is None or max_nodes <= 0 or max_depth <= 0:
            return out_tokens, parents
        heap: list[tuple[float, int, int, int, _Node]] = []  # (-prob, depth, token, parent, node)

        def offer(at: _Node, prob: float, depth: int, parent: int) -> None:
            total = sum(c.count for c in at.children.values())
            for t, child in at.children.items():
                p = prob * child.count / total
                if p >= min_prob:
                    heapq.heappush(heap, (-p, depth, t, parent, child))

        offer(node, 1.0, 1, -1)
        while heap and len(out_tokens) < max_nodes:
            neg_p, depth, t, parent, child = heapq.heappop(heap)
            out_tokens.append(t)
            parents.append(parent)
            if depth < max_depth and child.children:
                offer(child, -neg_p, depth + 1, len(out_tokens) - 1)
        return out_tokens, parents

    def branches(
        self, tokens: Sequence[int], max_tokens: int, max_branches: int, min_match: int = 1
    ) -> list[list[int]]:
        """Up to ``max_branches`` continuations (at most ``max_tokens`` each) of the suffix
        :meth:`continuation` matches, as chains for a draft tree (merge them with
        ``DraftTree.from_chains``; they share their common prefixes). The first is
        :meth:`continuation`'s; each next one leaves an earlier chain at the most frequent
        child not yet in a chain (highest count; ties: the shallower, then the lower token id)
        and follows the most frequent children from there. ``[]`` when nothing matches."""
        node, _ = self.match(tokens, max_tokens, min_match)
        if node is None or max_tokens <= 0 or max_branches <= 0:
            return []
        chains: list[list[int]] = []
        taken: set[tuple[int, ...]] = set()
        heap: list[tuple[int, int, int, tuple[int, ...]]] = []  # (-count, depth, token, path)
        at_path: dict[tuple[int, ...], _Node] = {}
        start: tuple[tuple[int, ...], _Node] = ((), node)
        while len(chains) < max_branches:
            prefix, at = start
            chain = self._follow(at, list(prefix), max_tokens)
            chains.append(chain)
            # the new chain's nodes below its branch point offer their other children
            cur = at
            for j in range(len(prefix), len(chain)):
                for t, child in cur.children.items():
                    if t != chain[j]:
                        path = (*chain[:j], t)
                        at_path[path] = child
                        heapq.heappush(heap, (-child.count, j, t, path))
                cur = cur.children[chain[j]]
            taken.update(tuple(chain[: j + 1]) for j in range(len(chain)))
            while heap and heap[0][3] in taken:
                heapq.heappop(heap)
            if not heap:
                break
            path = heapq.heappop(heap)[3]
            start = (path, at_path[path])
        return chains


def _size(node: _Node) -> int:
    n, stack = 0, [node]
    while stack:
        x = stack.pop()
        n += 1
        stack.extend(x.children.values())
    return n


class OwnContext:
    """One request's own tokens (prompt and output), indexed for suffix matching without the
    trie: each position by the two tokens ending there (and each token's last position), built
    in a pass of dictionary appends (~0.3 us a token, against ~6 us a token to insert depth-8
    windows into the trie), as SuffixDecoding matches each request's prompt in a tree of its
    own (Oliaro et al., arXiv:2411.04975). Positions are indexed once each as the sequence
    grows (verified tokens never change)."""

    __slots__ = ("pairs", "last", "indexed")

    #: the most recent occurrences of the last two tokens compared per match
    CANDIDATES = 8

    def __init__(self) -> None:
        self.pairs: dict[tuple[int, int], list[int]] = {}  # (t[i-1], t[i]) -> positions i, oldest first
        self.last: dict[int, int] = {}  # token -> its last position
        self.indexed = 0  # positions < indexed are in the index

    def update(self, tokens: Sequence[int]) -> None:
        """Index the positions that have a following token (all but the last)."""
        stop = len(tokens) - 1
        start = self.indexed
        if start >= stop:
            return
        pairs, last = self.pairs, self.last
        prev = tokens[start - 1] if start > 0 else None
        for i in range(start, stop):
            t = tokens[i]
            last[t] = i
            if prev is not None:
                key = (prev, t)
                at = pairs.get(key)
                if at is None:
                    pairs[key] = [i]
                else:
                    at.append(i)
            prev = t
        self.indexed = stop

    def match(self, tokens: Sequence[int], longest: int, min_match: int = 1) -> tuple[int, int]:
        """``(position, length)``: the end of the most recent earlier occurrence of the longest
        suffix of ``tokens`` (at most ``longest`` tokens, at least ``min_match``), or ``(-1, 0)``.
        Call :meth:`update` with ``tokens`` first."""
        n = len(tokens)
        if n >= 2 and longest >= 2:
            at = self.pairs.get((tokens[n - 2], tokens[n - 1]))
            if at:
                best, best_len = -1, 0
                for c in reversed(at[-self.CANDIDATES :]):
                    length = 2
                    while length < longest and c - length >= 0 and tokens[c - length] == tokens[n - 1 - length]:
                        length += 1
                    if length > best_len:
                        best, best_len = c, length
                        if length >= longest:
                            break
                if best_len >= min_match:
                    return best, best_len
        if min_match <= 1 and n >= 1:
            c = self.last.get(tokens[n - 1], -1)
            if c >= 0:
                return c, 1
        return -1, 0


class Progress:
    """Per-request bookkeeping shared by the store-based proposers: how far a request's
    sequence has been inserted. Released on ``finish``."""

    def __init__(self) -> None:
        self.inserted: dict[str, int] = {}

    def advance(self, request_id: str, n_ready: int) -> tuple[int, int]:
        """``(start, stop)``: the window starts not yet inserted, up to ``n_ready``."""
        start = self.inserted.get(request_id, 0)
        stop = max(start, n_ready)
        self.inserted[request_id] = stop
        return start, stop

    def release(self, request_id: str) -> None:
        self.inserted.pop(request_id, None)

    def __len__(self) -> int:
        return len(self.inserted)
