"""The expert-mask scheduler: an ``adjust_logits`` step (see ``reference.py``)."""
from __future__ import annotations

from collections import Counter
from typing import Any

from vllm_graft.hooks import MoEModel, MoEScheduler

from .reference import MaskTable


class ExpertMaskScheduler(MoEScheduler):
    def __init__(self, params) -> None:
        super().__init__(params)
        self.mask = params.mask()
        self.table: MaskTable | None = None
        self.calls: Counter = Counter()  # layer -> layer calls that changed logits
        self.tokens = 0

    def bind(self, model: MoEModel) -> None:
        self.mask.check(model.num_layers, model.num_experts, model.top_k, model.moe_layers)
        self.table = MaskTable(self.mask, model.moe_layers)

    def adjust_logits(self, layer_idx, router_logits):
        if self.table is None:  # not bound (no model facts at activation): check what we can
            E = router_logits.shape[-1]
            bad = sorted(e for side in (self.mask.off, self.mask.on) for s in side.values() for e in s if e >= E)
            if bad:
                raise ValueError(f"expert-mask: expert(s) {bad} out of range for {E} experts")
            self.table = MaskTable(self.mask, sorted(self.mask.layers_named() | {layer_idx}))
        if layer_idx not in self.table.off:
            self.table = MaskTable(self.mask, sorted(set(self.table.off) | {layer_idx}))
        out = self.table.apply(layer_idx, router_logits, self.params.margin)
        if out is not router_logits:
            self.calls[layer_idx] += 1
            self.tokens += router_logits.shape[0]
        return out

    def describe(self) -> dict[str, Any]:
        m = self.mask
        return {"off": {str(k): sorted(v) for k, v in m.off.items() if v},
                "on": {str(k): sorted(v) for k, v in m.on.items() if v},
                "masked_layer_calls": sum(self.calls.values()), "masked_tokens": self.tokens}
