"""Dynamic top-k routing (MC-MoE's online pruning), in plain PyTorch: the oracle of the
Triton kernel and the CPU path; and the scheduler (:class:`DynamicTopK`, a ``route`` step by
this reference or, with ``kernel: triton``, the kernel of :mod:`.kernel`) with its count of the
expert evaluations kept and saved (:class:`Savings`).

For each token, the router's softmax top-k is computed as the model would (``p = softmax(
logits)``, the k largest, weights ``w_1 >= ... >= w_k``; with ``renormalize`` they sum to 1),
then confident tokens keep fewer experts:

* ``criterion="mass"``: keep the fewest leading experts whose share of the top-k mass
  (``w_j / sum(w)``) reaches ``threshold``; for top-2 this is "drop the second expert when
  the first has at least ``threshold`` of the weight";
* ``criterion="entropy"``: keep only ``min_k`` experts when the router's normalised entropy
  ``H(p) / log E`` is below ``threshold``, else all k.

Never fewer than ``min_k`` (>= 1). A pruned slot gets weight 0 and the id of the token's top
expert (vLLM's layout wants ``[T, k]``; the contract says unused slots carry weight 0 and a
valid id). With ``renormalize`` the kept weights are renormalised to sum to 1 (the token's
output is then a convex mix of the experts it kept, as with a smaller top-k); without it they
keep their softmax probabilities.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from ....hooks import MoEModel, MoEScheduler

CRITERIA = ("mass", "entropy")


def dynamic_topk(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    *,
    threshold: float,
    criterion: str = "mass",
    min_k: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(weights [T, k] float32, ids [T, k] int64, kept [T] int64)``; experts in descending
    logit order; slots ``j >= kept[t]`` are pruned (weight 0, id = ``ids[t, 0]``)."""
    if criterion not in CRITERIA:
        raise ValueError(f"unknown criterion {criterion!r}; accepted: {', '.join(CRITERIA)}")
    min_k = max(1, min(min_k, top_k))
    logits = router_logits.float()
    T, E = logits.shape
    top_logits, ids = logits.topk(top_k, dim=-1)
    share = top_logits.softmax(dim=-1)  # w_j / sum(w): the renormalised top-k weights
    if criterion == "mass":
        before = share.cumsum(dim=-1) - share  # mass of the experts ranked above j
        keep = before < threshold
    else:
        logp = logits.log_softmax(dim=-1)
        p = logp.exp()
        ent = -(torch.where(p > 0, p * logp, torch.zeros_like(p))).sum(-1) / math.log(E)
        confident = (ent < threshold).unsqueeze(-1)
        keep = ~confident.expand(T, top_k)
    rank = torch.arange(top_k, device=logits.device).expand(T, top_k)
    keep = keep | (rank < min_k)
    kept = keep.sum(-1)
    if renormalize:
        kept_share = torch.where(keep, share, torch.zeros_like(share))
        weights = kept_share / kept_share.sum(-1, keepdim=True)
    else:
        probs = (top_logits - logits.logsumexp(dim=-1, keepdim=True)).exp()
        weights = torch.where(keep, probs, torch.zeros_like(probs))
    ids = torch.where(keep, ids, ids[:, :1].expand(T, top_k))
    return weights, ids, kept


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
        return {
            "routings": self.tokens,
            "expert_evaluations": self.evaluations,
            "evaluations_topk": self.full,
            "saved_share": round(self.saved_share, 4),
            "kept_histogram": {str(k): v for k, v in sorted(self.histogram.items())},
            "saved_share_per_layer": {
                str(l): round(1 - ev / (n * self.top_k), 4) if n else 0.0
                for l, (n, ev) in sorted(self.per_layer.items())
            },
        }


class DynamicTopK(MoEScheduler):
    def __init__(self, params) -> None:
        super().__init__(params)
        self.savings = Savings()
        self._kernel = None
        self.kernel_calls = 0
        if params.kernel == "triton":
            if os.environ.get("TRITON_INTERPRET") != "1":
                if not torch.cuda.is_available():
                    raise ValueError(
                        "dynamic-topk: kernel 'triton' needs a GPU, or TRITON_INTERPRET=1 set "
                        "before the engine starts (CPU emulation, slow)"
                    )
            from .kernel import dynamic_topk_triton

            self._kernel = dynamic_topk_triton

    def bind(self, model: MoEModel) -> None:
        if self.params.min_k > model.top_k:
            raise ValueError(f"min_k {self.params.min_k} is above the model's top-{model.top_k}")
        if model.top_k == 1:
            raise ValueError("the model routes each token to one expert (top-1): nothing to prune")

    def route(self, layer_idx, router_logits, top_k, renormalize):
        p = self.params
        if self._kernel is not None:
            x = router_logits if router_logits.dtype in (torch.float32, torch.float16) else router_logits.float()
            weights, ids, kept = self._kernel(
                x, top_k, renormalize, threshold=p.threshold, criterion=p.criterion, min_k=p.min_k
            )
        else:
            weights, ids, kept = dynamic_topk(
                router_logits, top_k, renormalize, threshold=p.threshold, criterion=p.criterion, min_k=p.min_k
            )
        self.kernel_calls += self._kernel is not None
        counts = kept.bincount(minlength=top_k + 1).tolist()
        self.savings.add(layer_idx, top_k, {k: c for k, c in enumerate(counts) if c})
        return weights, ids.long()

    def reset_stats(self) -> None:
        self.savings = Savings()

    def describe(self) -> dict[str, Any]:
        return {
            "criterion": self.params.criterion,
            "threshold": self.params.threshold,
            "path": "triton kernel" if self._kernel is not None else "reference",
            "kernel_calls": self.kernel_calls,
            **self.savings.describe(),
        }
