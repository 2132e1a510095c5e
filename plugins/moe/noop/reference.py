import torch

from vllm_graft.hooks import MoEScheduler


def softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    probs = router_logits.float().softmax(dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class TopK(MoEScheduler):
    def route(self, layer_idx, router_logits, top_k, renormalize):
        return softmax_topk(router_logits, top_k, renormalize)
