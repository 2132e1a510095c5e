"""Dynamic top-k routing (MC-MoE's online pruning), in plain PyTorch: the oracle of the
Triton kernel and the CPU path.

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

import torch

CRITERIA = ("mass", "entropy")


def dynamic_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool, *, threshold: float,
                 criterion: str = "mass", min_k: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
