"""Softmax top-k routing, computed the way vLLM's CPU router computes it.

Top-k is taken on the logits (softmax is monotonic, so these are the top-k probabilities
too, without ties introduced by rounding), then

* ``renormalize=True`` (Mixtral): the weights are a softmax over the k chosen logits, which
  equals the chosen probabilities divided by their sum;
* ``renormalize=False``: the weights are the chosen experts' softmax probabilities over all
  experts, ``exp(logit - logsumexp(logits))``.

In float32 this is bit-for-bit what vLLM's ``CPURouter`` (``fused_moe/router/cpu_router.py:
_softmax_topk``) returns, so the noop plugin gives plain vLLM's greedy tokens. For float16 /
bfloat16 logits vLLM's CPU router computes the softmax in that dtype; this computes it in
float32 (as vLLM's GPU ``fused_topk`` does), so there the weights may differ in the last bits.
"""

import torch

from ....hooks import MoEScheduler


def softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    """``(weights [T, k] float32, ids [T, k] int64)``, experts in descending logit order."""
    logits = router_logits.float()
    top_logits, ids = logits.topk(top_k, dim=-1)
    if renormalize:
        weights = top_logits.softmax(dim=-1)
    else:
        weights = (top_logits - logits.logsumexp(dim=-1, keepdim=True)).exp()
    return weights, ids


class TopK(MoEScheduler):
    def route(self, layer_idx, router_logits, top_k, renormalize):
        return softmax_topk(router_logits, top_k, renormalize)
