"""Bookkeeping of dynamic top-k, pure Python: expert evaluations done and saved."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Savings:
    """Per token and MoE layer: how many experts it kept out of the model's top-k."""

    top_k: int = 0
    tokens: int = 0  # token x layer routings
    evaluations: int = 0  # expert evaluations kept (sum of kept)
    histogram: Counter = field(default_factory=Counter)  # kept -> token x layer routings
    per_layer: dict[int, list[int]] = field(default_factory=dict)  # layer -> [tokens, evaluations]

    def add(self, layer: int, top_k: int, kept_counts: dict[int, int]) -> None:
        """``kept_counts``: {experts kept: tokens} for one layer call."""
        if any(k < 1 or k > top_k for k in kept_counts):
            raise ValueError(f"kept counts {sorted(kept_counts)} outside 1..{top_k}")
        self.top_k = max(self.top_k, top_k)
        n = sum(kept_counts.values())
        ev = sum(k * c for k, c in kept_counts.items())
        self.tokens += n
        self.evaluations += ev
        self.histogram.update(kept_counts)
        row = self.per_layer.setdefault(layer, [0, 0])
        row[0] += n
        row[1] += ev

    @property
    def full(self) -> int:
        """Evaluations the model's own top-k would have done."""
        return self.tokens * self.top_k

    @property
    def saved_share(self) -> float:
        return 1 - self.evaluations / self.full if self.full else 0.0

    def describe(self) -> dict:
        return {"routings": self.tokens, "expert_evaluations": self.evaluations,
                "evaluations_topk": self.full, "saved_share": round(self.saved_share, 4),
                "kept_histogram": {str(k): v for k, v in sorted(self.histogram.items())},
                "saved_share_per_layer": {str(l): round(1 - ev / (n * self.top_k), 4) if n else 0.0
                                          for l, (n, ev) in sorted(self.per_layer.items())}}
