"""The expert-cache scheduler: the residency policy of ``policy.py`` on live routing."""

from __future__ import annotations

from typing import Any

from ....hooks import MoEModel, MoEScheduler

from .._shared import StepAssembler, step_sets
from .policy import ExpertCache


class ExpertCacheScheduler(MoEScheduler):
    def __init__(self, params) -> None:
        super().__init__(params)
        self.cache: ExpertCache | None = None
        self.assembler: StepAssembler | None = None
        self.model: MoEModel | None = None

    def bind(self, model: MoEModel) -> None:
        p = self.params
        C = p.capacity if p.capacity is not None else max(model.top_k, model.num_experts // 4)
        if C > model.num_experts:
            raise ValueError(f"capacity {C} is more than the model's {model.num_experts} experts per layer")
        if C < model.top_k:
            raise ValueError(f"capacity {C} is below the model's top-{model.top_k}: a token's experts must fit")
        self.model = model
        self.capacity = C
        self.cache = ExpertCache(
            len(model.moe_layers), model.num_experts, C, p.policy, p.prefetch if p.policy == "affinity" else 0
        )
        self.assembler = StepAssembler(model.moe_layers)

    def observe(self, layer_idx, topk_ids, topk_weights):
        for row in step_sets(self.assembler, layer_idx, topk_ids, topk_weights):
            self.cache.token(row)

    def reset_stats(self) -> None:
        if self.model is not None:
            self.bind(self.model)

    def describe(self) -> dict[str, Any]:
        if self.cache is None:
            return {}
        return {
            "policy": self.params.policy,
            "capacity": self.capacity,
            **self.cache.stats.describe(self.params.expert_bytes),
        }
