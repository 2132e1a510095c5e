"""Masking router logits before top-k (MoTE), in plain PyTorch: the oracle and the CPU path;
and the scheduler (:class:`ExpertMaskScheduler`, an ``adjust_logits`` step) that applies the
mask of :mod:`.policy` per layer.

* switched off: the expert's logit becomes ``-inf``, so top-k never picks it and (with
  ``renormalize``) it takes no weight;
* forced on: the expert's logit becomes ``max(own logit, best other logit + margin)`` (the
  next representable value above, so even with margin 0 it wins ties): it
  ranks above every expert that is not forced, so it is always in the top-k (at most top-k
  experts are forced: checked at activation), and its weight is what the router would give
  the best expert (an expert already on top keeps its own logit, and its weight).

A layer with nothing to mask gets its logits back unchanged (the same tensor): an empty mask
is exactly the model's routing.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from ....hooks import MoEModel, MoEScheduler


def mask_logits(
    router_logits: torch.Tensor, off: torch.Tensor | None, on: torch.Tensor | None, margin: float = 0.0
) -> torch.Tensor:
    """``router_logits [T, E]`` with the experts of ``off`` (int64 ids) at ``-inf`` and those
    of ``on`` raised above every other expert. ``None`` or empty: nothing to do."""
    has_off = off is not None and off.numel() > 0
    has_on = on is not None and on.numel() > 0
    if not (has_off or has_on):
        return router_logits
    out = router_logits.clone()
    if has_off:
        out[:, off] = float("-inf")
    if has_on:
        others = out.clone()
        others[:, on] = float("-inf")
        best = others.max(dim=-1, keepdim=True).values  # [T, 1] best expert not forced on
        # strictly above the best other expert, even with margin 0 (ties would leave top-k free
        # to pick the other one)
        floor = torch.nextafter(best + margin, torch.full_like(best, float("inf")))
        forced = torch.maximum(out[:, on], floor)
        out[:, on] = forced
    return out


class MaskTable:
    """Per decoder layer, the ``off`` / ``on`` id tensors, built once from an ExpertMask."""

    def __init__(self, mask, layers) -> None:
        self.off: dict[int, torch.Tensor | None] = {}
        self.on: dict[int, torch.Tensor | None] = {}
        for layer in layers:
            off, on = sorted(mask.off_in(layer)), sorted(mask.on_in(layer))
            self.off[layer] = torch.tensor(off, dtype=torch.long) if off else None
            self.on[layer] = torch.tensor(on, dtype=torch.long) if on else None

    def apply(self, layer: int, logits: torch.Tensor, margin: float) -> torch.Tensor:
        off, on = self.off.get(layer), self.on.get(layer)
        if off is not None and off.device != logits.device:
            off = self.off[layer] = off.to(logits.device)
        if on is not None and on.device != logits.device:
            on = self.on[layer] = on.to(logits.device)
        return mask_logits(logits, off, on, margin)


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
        return {
            "off": {str(k): sorted(v) for k, v in m.off.items() if v},
            "on": {str(k): sorted(v) for k, v in m.on.items() if v},
            "masked_layer_calls": sum(self.calls.values()),
            "masked_tokens": self.tokens,
        }
