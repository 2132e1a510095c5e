"""The dynamic-topk scheduler: a ``route`` step (reference or Triton kernel)."""
from __future__ import annotations

import os
from typing import Any

import torch

from vllm_graft.hooks import MoEModel, MoEScheduler

from .policy import Savings
from .reference import dynamic_topk


class DynamicTopK(MoEScheduler):
    def __init__(self, params) -> None:
        super().__init__(params)
        self.savings = Savings()
        self._kernel = None
        self.kernel_calls = 0
        if params.kernel == "triton":
            if os.environ.get("TRITON_INTERPRET") != "1":
                if not torch.cuda.is_available():
                    raise ValueError("dynamic-topk: kernel 'triton' needs a GPU, or TRITON_INTERPRET=1 set "
                                     "before the engine starts (CPU emulation, slow)")
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
            weights, ids, kept = self._kernel(x, top_k, renormalize, threshold=p.threshold,
                                              criterion=p.criterion, min_k=p.min_k)
        else:
            weights, ids, kept = dynamic_topk(router_logits, top_k, renormalize, threshold=p.threshold,
                                              criterion=p.criterion, min_k=p.min_k)
        self.kernel_calls += self._kernel is not None
        counts = kept.bincount(minlength=top_k + 1).tolist()
        self.savings.add(layer_idx, top_k, {k: c for k, c in enumerate(counts) if c})
        return weights, ids.long()

    def reset_stats(self) -> None:
        self.savings = Savings()

    def describe(self) -> dict[str, Any]:
        return {"criterion": self.params.criterion, "threshold": self.params.threshold,
                "path": "triton kernel" if self._kernel is not None else "reference",
                "kernel_calls": self.kernel_calls,
                **self.savings.describe()}
