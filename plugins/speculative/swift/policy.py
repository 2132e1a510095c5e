"""SWIFT's layer-set search, free of tensors: which sub-layers the draft model skips.

Sub-layers are numbered ``2 * i`` (attention of layer ``i``) and ``2 * i + 1`` (its MLP),
as SWIFT and Draft & Verify skip attention and MLP blocks independently. The search gets a
``score(skip_set) -> float`` (in SWIFT: how often the skipped model's greedy next token
matches the full model's on the context, :func:`.reference.match_scorer`) and spends at most
``budget`` evaluations of it:

1. a deterministic seed candidate: the skippable sub-layers evenly spread from the back of
   the stack (late layers of trained decoders change the residual stream least);
2. random candidates (SWIFT's random search phase), about half the budget;
3. local search from the best so far (swap one skipped sub-layer for a kept one, keep the
   swap when the score does not drop), standing in for SWIFT's Bayesian-optimisation phase.

Deterministic for a given ``seed``; no set is scored twice. The random phase keeps the first
of equal scores; the local phase moves to an equal-scoring neighbour (crossing plateaus).
"""

from __future__ import annotations

import random
from math import comb
from typing import Callable, Sequence


def skippable_sublayers(num_layers: int, keep_ends: bool = True) -> list[int]:
    """The sub-layers a search may skip: all, or all but those of the first and last layer."""
    layers = range(1, num_layers - 1) if keep_ends else range(num_layers)
    return [s for i in layers for s in (2 * i, 2 * i + 1)]


def spread(candidates: Sequence[int], n: int) -> frozenset[int]:
    """``n`` of ``candidates`` evenly spread, the last one always included."""
    m = len(candidates)
    if n <= 0:
        return frozenset()
    return frozenset(candidates[m - 1 - (j * m) // n] for j in range(n))


class LayerSkipSearch:
    """Search for the ``n_skip`` of ``candidates`` to skip that maximise a score."""

    def __init__(self, candidates: Sequence[int], n_skip: int, *, budget: int, seed: int = 0) -> None:
        if not 0 < n_skip <= len(candidates):
            raise ValueError(f"n_skip must be in 1..{len(candidates)} (the skippable sub-layers), got {n_skip}")
        if budget < 1:
            raise ValueError(f"budget must be at least 1, got {budget}")
        self.candidates = list(candidates)
        self.n_skip, self.budget = n_skip, budget
        self.rng = random.Random(seed)
        self.scores: dict[frozenset[int], float] = {}

    @property
    def evaluated(self) -> int:
        """Skip sets scored so far (each once)."""
        return len(self.scores)

    def _score(self, skip: frozenset[int], score: Callable[[frozenset[int]], float]) -> float:
        if skip not in self.scores:
            self.scores[skip] = float(score(skip))
        return self.scores[skip]

    def run(self, score: Callable[[frozenset[int]], float]) -> tuple[frozenset[int], float]:
        """The best skip set found and its score."""
        budget = min(self.budget, comb(len(self.candidates), self.n_skip))
        best = spread(self.candidates, self.n_skip)
        best_score = self._score(best, score)
        # random phase: about half the budget
        tries = 0
        while self.evaluated < max(1, budget // 2) and tries < 20 * budget:
            tries += 1
            cand = frozenset(self.rng.sample(self.candidates, self.n_skip))
            if cand in self.scores:
                continue
            s = self._score(cand, score)
            if s > best_score:
                best, best_score = cand, s
        # local phase: swap one skipped for one kept
        tries = 0
        while self.evaluated < budget and tries < 20 * budget:
            tries += 1
            kept = [c for c in self.candidates if c not in best]
            if not kept:
                break
            out, into = self.rng.choice(sorted(best)), self.rng.choice(kept)
            cand = (best - {out}) | {into}
            if cand in self.scores:
                continue
            s = self._score(cand, score)
            if s >= best_score:
                best, best_score = cand, s
        return best, best_score
