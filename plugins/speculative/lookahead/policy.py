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
import math
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


class Calibration:
    """Draft lengths from measured acceptance (``calibrate: true``). Each *kind* of match, the
    request's own text or other requests' outputs (:class:`SharedOutputs`) by the matched length
    (1, 2, ..., 7, 8-15, 16 and more),
    keeps the rate at which the drafts it made were accepted, token by token: ``q = accepted /
    (accepted + rejections)`` (a draft's tokens are accepted up to the first rejection, so under
    a geometric model a draft of ``j`` tokens is accepted whole with chance ``q^j``), decayed by
    ``decay`` per observation, from ``prior`` with the weight of ``prior_weight`` observations.

    A draft runs while ``q^j >= B / (fixed_cost_tokens + B)`` at batch size ``B`` (the cost
    model of SmartSpec, Liu et al., arXiv:2406.14066, per token: a step costs its fixed part,
    ``fixed_cost_tokens`` token-equivalents, plus one per token it computes, so a draft token is
    worth its cost when it is accepted at least that often). Copying, accepted near always,
    drafts long at any batch size; a one-token guess drafts at batch 1 and not at batch 32. A
    kind whose rate keeps it at 0 drafts one token every ``probe_every`` proposals, so its rate
    can recover when the text changes."""

    __slots__ = ("cost", "prior", "prior_weight", "decay", "probe_every", "batch", "stats", "pending", "idle")

    def __init__(
        self,
        fixed_cost_tokens: float,
        *,
        prior: float = 0.5,
        prior_weight: float = 2.0,
        decay: float = 0.995,
        probe_every: int = 16,
    ) -> None:
        if fixed_cost_tokens <= 0:
            raise ValueError(f"fixed_cost_tokens must be positive, got {fixed_cost_tokens}")
        self.cost, self.prior, self.prior_weight = fixed_cost_tokens, prior, prior_weight
        self.decay, self.probe_every = decay, probe_every
        self.batch = 1
        self.stats: dict[tuple[str, int], list[float]] = {}  # kind -> [accepted, rejections]
        self.pending: dict[str, tuple[str, int]] = {}  # request -> the kind of its last draft
        self.idle: dict[tuple[str, int], int] = {}  # kind -> proposals held at 0 since its last draft

    @staticmethod
    def kind(source: str, matched: int) -> tuple[str, int]:
        return source, (matched if matched < 8 else 8 if matched < 16 else 16)

    def rate(self, kind: tuple[str, int]) -> float:
        s, f = self.stats.get(kind, (0.0, 0.0))
        return (s + self.prior * self.prior_weight) / (s + f + self.prior_weight)

    def length(self, request_id: str, kind: tuple[str, int], most: int) -> int:
        """How many of up to ``most`` tokens a draft of this kind runs to now (0: none); the
        request's next :meth:`observe` is credited to ``kind``."""
        q, floor = self.rate(kind), self.batch / (self.cost + self.batch)
        n = 0
        if q >= floor:
            n = most if q >= 1.0 else min(most, int(math.log(floor) / math.log(q) + 1e-9))
        if n == 0 and most > 0:
            self.idle[kind] = self.idle.get(kind, 0) + 1
            if self.idle[kind] >= self.probe_every:
                n = 1
        if n > 0:
            self.idle[kind] = 0
            self.pending[request_id] = kind
        else:
            self.pending.pop(request_id, None)
        return n

    def observe(self, request_id: str, num_accepted: int, num_verified: int) -> None:
        kind = self.pending.pop(request_id, None)
        if kind is None or num_verified <= 0:
            return
        st = self.stats.setdefault(kind, [0.0, 0.0])
        st[0] = st[0] * self.decay + num_accepted
        st[1] = st[1] * self.decay + (1.0 if num_accepted < num_verified else 0.0)

    def release(self, request_id: str) -> None:
        self.pending.pop(request_id, None)


class SharedOutputs:
    """Every request's output tokens, indexed by the three tokens ending at each position (as
    :class:`OwnContext` indexes one request's text by two), so that a request matches what other requests
    generated: at once (the trie takes a window only once ``depth`` tokens of it exist) and with a
    continuation as long as the other output goes on (a trie's is at most its depth), as
    SuffixDecoding's global tree holds earlier responses (Oliaro et al., arXiv:2411.04975).

    Holds at most ``max_tokens`` tokens: past that, the outputs of finished requests go, the
    oldest first. Their index entries are skipped by :meth:`match` and dropped all at once when
    they outnumber the live ones."""

    __slots__ = ("texts", "starts", "pairs", "done", "size", "entries", "max_tokens", "_next")

    #: the most recent occurrences of the last three tokens compared per match
    CANDIDATES = 8
    #: a draft from several occurrences follows their vote while its estimated probability is at
    #: least this (:meth:`continuation`): 0.5 keeps a majority path
    MIN_PROB = 0.5

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.texts: dict[int, list[int]] = {}  # output id -> its tokens so far
        self.starts: dict[str, tuple[int, int]] = {}  # live request -> (output id, where its output starts)
        self.pairs: dict[tuple[int, int, int], list[tuple[int, int]]] = {}  # -> (output id, position), oldest first
        self.done: list[int] = []  # output ids of finished requests, oldest first
        self.size = 0
        self.entries = 0  # index entries, those of outputs that went included
        self._next = 0

    def update(self, request_id: str, tokens: Sequence[int]) -> None:
        """Index the request's output tokens not indexed yet (its output starts where its first
        call found it: every token after the first call's next-to-last)."""
        entry = self.starts.get(request_id)
        if entry is None:
            entry = self.starts[request_id] = (self._next, max(0, len(tokens) - 1))
            self.texts[self._next] = []
            self._next += 1
        oid, start = entry
        text = self.texts[oid]
        new = tokens[start + len(text) :]
        if not new:
            return
        pairs = self.pairs
        for t in new:
            if len(text) >= 2:
                key = (text[-2], text[-1], t)
                at = pairs.get(key)
                if at is None:
                    pairs[key] = [(oid, len(text))]
                else:
                    at.append((oid, len(text)))
                self.entries += 1
            text.append(t)
        self.size += len(new)

    def finish(self, request_id: str) -> None:
        entry = self.starts.pop(request_id, None)
        if entry is None:
            return
        self.done.append(entry[0])
        while self.size > self.max_tokens and self.done:
            self.size -= len(self.texts.pop(self.done.pop(0)))
        if self.entries > 2 * self.size + 1024:  # entries of outputs that went: drop them
            texts = self.texts
            self.pairs = {k: kept for k, v in self.pairs.items() if (kept := [e for e in v if e[0] in texts])}
            self.entries = sum(len(v) for v in self.pairs.values())

    def match(
        self, request_id: str, tokens: Sequence[int], longest: int, min_match: int = 2
    ) -> tuple[list[tuple[list[int], int]], int]:
        """``(candidates, length)``: the longest suffix of ``tokens`` (3 to ``longest`` tokens, at
        least ``min_match``) found in other requests' outputs, and each occurrence of it among
        the ``CANDIDATES`` most recent ones of its last three tokens (of at most twice as many
        looked at), as ``(text, position)`` (the suffix ends at ``text[position]``), the most
        recent first; ``([], 0)`` when none."""
        n = len(tokens)
        if n < 3 or longest < 3:
            return [], 0
        at = self.pairs.get((tokens[n - 3], tokens[n - 2], tokens[n - 1]))
        if not at:
            return [], 0
        own = self.starts.get(request_id, (-1, 0))[0]
        texts = self.texts
        longest = min(longest, n)
        tail = list(tokens[n - longest :])  # compared whole first (in C): copying matches in full
        found: list[tuple[int, list[int], int]] = []
        for examined, (oid, c) in enumerate(reversed(at)):
            if len(found) >= self.CANDIDATES or examined >= 2 * self.CANDIDATES:
                break
            text = texts.get(oid)
            if oid == own or text is None or c + 1 >= len(text):
                continue  # its own output, one that went, or nothing follows it yet
            if c + 1 >= longest and text[c + 1 - longest : c + 1] == tail:
                length = longest
            else:
                length = 3
                while length < longest and c - length >= 0 and text[c - length] == tokens[n - 1 - length]:
                    length += 1
            found.append((length, text, c))
        best = max((f[0] for f in found), default=0)
        if best < max(3, min_match):
            return [], 0
        return [(text, c) for length, text, c in found if length == best], best

    @staticmethod
    def continuation(candidates: Sequence[tuple[list[int], int]], n: int, min_prob: float) -> list[int]:
        """Up to ``n`` tokens continuing ``candidates`` (from :meth:`match`) by vote, as a suffix
        tree follows its most frequent child: at each position the token most of the candidates
        still in agreement continue with (ties: the most recent), the others dropped, while the
        path's estimated probability (the product of each position's share among the candidates
        that have a next token) stays at least ``min_prob``."""
        if len(candidates) == 1:
            text, c = candidates[0]
            return text[c + 1 : c + 1 + n]
        alive = [(text, c + 1) for text, c in candidates]
        out: list[int] = []
        prob = 1.0
        while alive and len(out) < n:
            counts: dict[int, int] = {}
            for text, p in alive:
                if p < len(text):
                    counts[text[p]] = counts.get(text[p], 0) + 1
            if not counts:
                break
            token = max(counts, key=counts.__getitem__)  # first seen on ties: the most recent
            prob *= counts[token] / sum(counts.values())
            if prob < min_prob:
                break
            out.append(token)
            alive = [(text, p + 1) for text, p in alive if p < len(text) and text[p] == token]
        return out
