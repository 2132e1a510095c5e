"""Pooled n-gram drafting after STAND (Song et al., "Accelerated Test-Time Scaling with
Model-Free Speculative Sampling", arXiv:2506.04708), as pure Python.

The target's own sampled continuations are pooled: every output token is counted as the
successor of the 1..``max_order`` tokens before it, in a pool shared by all requests whose
prompts start with the same ``prefix_tokens`` tokens (the n samples of one prompt, best-of-N,
retries, requests with one system prompt). Drafting extends the sequence with the most
frequent successor of its longest known context (``max_order`` down to ``min_order``),
token by token. (STAND also keeps successor *distributions* to draft stochastic trees; with
vLLM's chain verifier the argmax path is what can be verified.)

Memory: at most ``max_pools`` pools (least recently used dropped), each at most
``max_contexts`` contexts; over that, all counts in the pool are halved and contexts whose
successors all reach 0 are dropped until it holds ``prune_to`` of the cap.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Sequence


class NgramPool:
    def __init__(self, max_order: int, max_contexts: int, prune_to: float = 0.75) -> None:
        self.max_order, self.max_contexts, self.prune_to = max_order, max_contexts, prune_to
        self.table: dict[tuple[int, ...], dict[int, int]] = {}
        self.prunes = 0

    def add(self, tokens: Sequence[int], pos: int) -> None:
        """Count ``tokens[pos]`` after each of its contexts of 1..max_order tokens."""
        nxt = tokens[pos]
        for n in range(1, min(self.max_order, pos) + 1):
            succ = self.table.setdefault(tuple(tokens[pos - n : pos]), {})
            succ[nxt] = succ.get(nxt, 0) + 1
        if len(self.table) > self.max_contexts:
            self.prune()

    def prune(self) -> None:
        target = int(self.prune_to * self.max_contexts)
        while len(self.table) > target:
            self.prunes += 1
            dead = []
            for ctx, succ in self.table.items():
                for t in list(succ):
                    succ[t] //= 2
                    if not succ[t]:
                        del succ[t]
                if not succ:
                    dead.append(ctx)
            for ctx in dead:
                del self.table[ctx]

    def draft(self, tokens: Sequence[int], max_tokens: int, min_order: int = 1) -> list[int]:
        seq = list(tokens[-self.max_order :])
        out: list[int] = []
        while len(out) < max_tokens:
            nxt = None
            for n in range(min(self.max_order, len(seq)), min_order - 1, -1):
                succ = self.table.get(tuple(seq[len(seq) - n :]))
                if succ:
                    nxt = max(succ.items(), key=lambda kv: (kv[1], -kv[0]))[0]
                    break
            if nxt is None:
                break
            out.append(nxt)
            seq.append(nxt)
        return out


class PoolStore:
    """Pools keyed by prompt prefix (LRU, at most ``max_pools``) and per-request progress."""

    def __init__(
        self,
        *,
        prefix_tokens: int,
        max_order: int,
        max_contexts: int,
        max_pools: int,
        include_prompt: bool,
        prune_to: float = 0.75,
    ) -> None:
        if min(prefix_tokens, max_order, max_contexts, max_pools) <= 0:
            raise ValueError("prefix_tokens, max_order, max_contexts and max_pools must be positive")
        self.prefix_tokens, self.max_order = prefix_tokens, max_order
        self.max_contexts, self.max_pools, self.prune_to = max_contexts, max_pools, prune_to
        self.include_prompt = include_prompt
        self.pools: OrderedDict[Hashable, NgramPool] = OrderedDict()
        self.requests: dict[str, list] = {}  # request id -> [pool key, next position to add]

    def pool(self, key: Hashable) -> NgramPool:
        pool = self.pools.get(key)
        if pool is None:
            pool = self.pools[key] = NgramPool(self.max_order, self.max_contexts, self.prune_to)
            while len(self.pools) > self.max_pools:
                self.pools.popitem(last=False)
        else:
            self.pools.move_to_end(key)
        return pool

    def observe(self, request_id: str, tokens: Sequence[int]) -> NgramPool:
        """Add what ``request_id`` produced since its last call; return its pool. On the
        first call the request's prompt is ``tokens[:-1]`` (the first call comes with the
        first sampled token)."""
        state = self.requests.get(request_id)
        if state is None:
            prompt_len = max(1, len(tokens) - 1)
            key = hash(tuple(tokens[: min(prompt_len, self.prefix_tokens)]))
            start = 1 if self.include_prompt else prompt_len
            state = self.requests[request_id] = [key, start]
        pool = self.pool(state[0])
        for pos in range(state[1], len(tokens)):
            pool.add(tokens, pos)
        state[1] = max(state[1], len(tokens))
        return pool

    def release(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    @property
    def num_contexts(self) -> int:
        return sum(len(p.table) for p in self.pools.values())
