"""Expert residency for offloaded experts (ExpertFlow / EdgeMoE), pure Python.

Each MoE layer has a cache holding at most ``C`` of its ``E`` experts (the rest live in slower
memory: host RAM for a GPU, flash for an edge device). Tokens are processed one after another
(in the order of the trace); in every layer a token needs the experts it was routed to (slots
of weight 0 excluded). A needed expert found in the cache is a hit; otherwise it is loaded (a
miss: ``expert_bytes`` moved), evicting a resident expert the token does not need, chosen by
the policy:

* ``lru``: the least recently used; ``lfu``: the least often used so far (ties: least recent);
* ``affinity`` (predictive prefetch): LRU, plus, once a token has been routed in layer ``l``,
  the ``prefetch`` experts of layer ``l+1`` most likely to follow are loaded ahead of time
  (each costs ``expert_bytes`` if not resident), from the inter-layer affinity counts learnt
  online from the tokens seen so far (ExFlow's affinity as ExpertFlow's predictor); layer 0
  has no previous layer and is plain LRU;
* ``belady``: evicts the expert used again farthest in the future (needs the future: the
  optimal demand-only policy, an upper bound on any hit rate without prefetch).

A cache never holds more than ``C`` experts; ``C`` must be at least the model's top-k (a
token's experts must fit together).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

POLICIES = ("lru", "lfu", "affinity", "belady")


class LayerCache:
    """One layer's resident experts (insertion-ordered = recency order, oldest first)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1 (got {capacity})")
        self.capacity = capacity
        self.resident: OrderedDict[int, None] = OrderedDict()
        self.freq: dict[int, int] = {}

    def __contains__(self, e: int) -> bool:
        return e in self.resident

    def __len__(self) -> int:
        return len(self.resident)

    def touch(self, e: int) -> None:
        self.resident.move_to_end(e)
        self.freq[e] = self.freq.get(e, 0) + 1

    def insert(self, e: int, keep: Iterable[int], victim_of) -> int | None:
        """Load ``e``; if full, evict ``victim_of(candidates)`` (never one of ``keep``).
        Returns the evicted expert."""
        evicted = None
        if e in self.resident:
            return None
        if len(self.resident) >= self.capacity:
            keep = set(keep)
            cands = [x for x in self.resident if x not in keep]
            if not cands:
                raise RuntimeError(f"cache of {self.capacity} cannot take expert {e}: all residents needed")
            evicted = victim_of(cands)
            del self.resident[evicted]
        self.resident[e] = None
        assert len(self.resident) <= self.capacity
        return evicted


@dataclass
class CacheStats:
    accesses: int = 0  # needed (token, layer, expert) uses
    hits: int = 0
    demand_loads: int = 0
    prefetch_loads: int = 0
    prefetch_used: int = 0  # prefetched experts that a later access hit before eviction
    tokens: int = 0
    per_layer: dict[int, list[int]] = field(default_factory=dict)  # layer -> [accesses, hits]

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def loads(self) -> int:
        return self.demand_loads + self.prefetch_loads

    def bytes_per_token(self, expert_bytes: int) -> float:
        return self.loads * expert_bytes / self.tokens if self.tokens else 0.0

    def describe(self, expert_bytes: int | None = None) -> dict:
        out = {
            "tokens": self.tokens,
            "accesses": self.accesses,
            "hit_rate": round(self.hit_rate, 4),
            "demand_loads": self.demand_loads,
            "prefetch_loads": self.prefetch_loads,
            "prefetch_used": self.prefetch_used,
            "hit_rate_per_layer": {
                str(l): round(h / a, 4) if a else 0.0 for l, (a, h) in sorted(self.per_layer.items())
            },
        }
        if expert_bytes:
            out["bytes_per_token"] = round(self.bytes_per_token(expert_bytes), 1)
        return out


class ExpertCache:
    """Residency of every MoE layer's experts under one policy; feed it tokens in order with
    :meth:`token` (``sets[l]``: the experts the token uses in MoE layer ``l``)."""

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        capacity: int,
        policy: str = "lru",
        prefetch: int = 0,
        future: "Sequence[Sequence[Sequence[int]]] | None" = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown cache policy {policy!r}; accepted: {', '.join(POLICIES)}")
        if not 1 <= capacity <= num_experts:
            raise ValueError(f"capacity {capacity} must be in 1..{num_experts} (experts per layer)")
        if policy == "affinity" and not 1 <= prefetch <= capacity:
            raise ValueError(f"affinity prefetch needs 1 <= prefetch <= capacity ({capacity}), got {prefetch}")
        if policy == "belady" and future is None:
            raise ValueError("belady needs the whole access sequence (future=...)")
        self.L, self.E, self.C = num_layers, num_experts, capacity
        self.policy, self.prefetch = policy, prefetch if policy == "affinity" else 0
        self.caches = [LayerCache(capacity) for _ in range(num_layers)]
        self.stats = CacheStats()
        self.affinity = np.zeros((max(num_layers - 1, 0), num_experts, num_experts))
        self._prefetched: list[set[int]] = [set() for _ in range(num_layers)]
        self._t = 0
        if policy == "belady":
            self._next = self._next_uses(future)

    # ---------------------------------------------------------------- belady
    def _next_uses(self, future) -> list[dict[int, list[int]]]:
        uses: list[dict[int, list[int]]] = [{} for _ in range(self.L)]
        for t, sets in enumerate(future):
            for l, s in enumerate(sets):
                for e in s:
                    uses[l].setdefault(e, []).append(t)
        for l in range(self.L):
            for e in uses[l]:
                uses[l][e].reverse()  # pop() gives the earliest remaining use
        return uses

    def _belady_victim(self, l: int, cands: list[int]) -> int:
        def next_use(e: int) -> float:
            q = self._next[l].get(e, [])
            while q and q[-1] <= self._t:
                q.pop()
            return q[-1] if q else float("inf")

        return max(cands, key=lambda e: (next_use(e), -list(self.caches[l].resident).index(e)))

    # ---------------------------------------------------------------- the policy
    def _victim(self, l: int, cands: list[int]) -> int:
        if self.policy == "lfu":
            order = {e: i for i, e in enumerate(self.caches[l].resident)}
            return min(cands, key=lambda e: (self.caches[l].freq.get(e, 0), order[e]))
        if self.policy == "belady":
            return self._belady_victim(l, cands)
        return cands[0]  # lru (and affinity's base): the oldest in recency order

    def token(self, sets: Sequence[Sequence[int]]) -> None:
        if len(sets) != self.L:
            raise ValueError(f"{len(sets)} layer sets for {self.L} layers")
        st = self.stats
        st.tokens += 1
        for l, need in enumerate(sets):
            need = list(dict.fromkeys(int(e) for e in need))
            if len(need) > self.C:
                raise ValueError(f"a token needs {len(need)} experts in layer {l}, cache capacity is {self.C}")
            cache = self.caches[l]
            row = st.per_layer.setdefault(l, [0, 0])
            for e in need:
                st.accesses += 1
                row[0] += 1
                if e in cache:
                    st.hits += 1
                    row[1] += 1
                    if e in self._prefetched[l]:
                        st.prefetch_used += 1
                        self._prefetched[l].discard(e)
                else:
                    st.demand_loads += 1
                    gone = cache.insert(e, need, lambda c, l=l: self._victim(l, c))
                    if gone is not None:
                        self._prefetched[l].discard(gone)
                cache.touch(e)
            if self.prefetch and l + 1 < self.L:
                self._prefetch_next(l, need)
        if self.L > 1:
            for l in range(self.L - 1):
                for i in dict.fromkeys(sets[l]):
                    for j in dict.fromkeys(sets[l + 1]):
                        self.affinity[l, int(i), int(j)] += 1
        self._t += 1

    def _prefetch_next(self, l: int, routed: list[int]) -> None:
        score = self.affinity[l][routed].sum(axis=0)
        if not score.any():
            return
        order = np.argsort(-score, kind="stable")[: self.prefetch]
        nxt = self.caches[l + 1]
        picked = [int(e) for e in order if score[e] > 0]
        for e in picked:
            if e in nxt:
                nxt.resident.move_to_end(e)  # keep the predicted ones from eviction
                continue
            gone = nxt.insert(e, picked, lambda c, l=l: self._victim(l + 1, c))
            if gone is not None:
                self._prefetched[l + 1].discard(gone)
            self._prefetched[l + 1].add(e)
            self.stats.prefetch_loads += 1
        for e in picked:
            nxt.resident.move_to_end(e)

    def resident(self, layer: int) -> list[int]:
        return list(self.caches[layer].resident)


def simulate(
    token_sets: Sequence[Sequence[Sequence[int]]], num_experts: int, capacity: int, policy: str, prefetch: int = 0
) -> CacheStats:
    """Run a whole sequence of tokens (``token_sets[t][l]``: experts of token ``t`` in layer ``l``)."""
    L = len(token_sets[0]) if len(token_sets) else 0
    cache = ExpertCache(L, num_experts, capacity, policy, prefetch, future=token_sets if policy == "belady" else None)
    for sets in token_sets:
        cache.token(sets)
    return cache.stats


def sets_from_trace(trace) -> list[list[list[int]]]:
    """A :class:`~vllm_graft.plugins.moe.route_trace.reference.Trace` as ``[token][layer] -> experts``
    (slots of weight 0 excluded)."""
    act = trace.active()
    ids = trace.ids
    L, N, k = ids.shape
    out = []
    for n in range(N):
        out.append([[int(ids[l, n, j]) for j in range(k) if act[l, n, j]] for l in range(L)])
    return out
