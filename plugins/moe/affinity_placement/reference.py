"""The affinity-placement scheduler: live inter-layer affinity and transfer counts."""

from __future__ import annotations

from typing import Any

import numpy as np

from ....hooks import MoEModel, MoEScheduler

from .._shared import StepAssembler, step_sets
from .policy import Placement, linear, round_robin, solve, volume


class AffinityPlacement(MoEScheduler):
    def __init__(self, params) -> None:
        super().__init__(params)
        self.model: MoEModel | None = None
        self.placement = Placement.load(params.placement_file) if params.placement_file else None
        self.assembler: StepAssembler | None = None
        self.A: np.ndarray | None = None
        self.tokens = 0

    def bind(self, model: MoEModel) -> None:
        E, N = model.num_experts, self.params.devices
        if E % N:
            raise ValueError(f"devices {N}: {E} experts do not split evenly over {N} devices")
        L = len(model.moe_layers)
        if self.placement is not None:
            p = self.placement
            if p.devices.shape != (L, E) or p.num_devices != N:
                raise ValueError(
                    f"the placement file is for {p.devices.shape[0]} layers x {p.devices.shape[1]} "
                    f"experts on {p.num_devices} devices; this model has {L} MoE layers x {E} "
                    f"experts and devices is {N}"
                )
        self.model = model
        self.assembler = StepAssembler(model.moe_layers)
        self.A = np.zeros((max(L - 1, 0), E, E))

    def expert_placement(self) -> list[list[int]] | None:
        """The placement file's ``physical_to_logical_map`` where ``apply`` is set (checked
        against the model by :meth:`bind`)."""
        if not self.params.apply or self.placement is None:
            return None
        return self.placement.to_vllm(self.model.moe_layers if self.model else [])["physical_to_logical_map"]

    def observe(self, layer_idx, topk_ids, topk_weights):
        sets = step_sets(self.assembler, layer_idx, topk_ids, topk_weights)
        self.tokens += len(sets)
        for row in sets:
            for l in range(len(row) - 1):
                for i in row[l]:
                    self.A[l, i, row[l + 1]] += 1

    def reset_stats(self) -> None:
        if self.A is not None:
            self.A[:] = 0
        self.tokens = 0

    def describe(self) -> dict[str, Any]:
        if self.A is None or not self.tokens:
            return {"tokens": self.tokens}
        L, E, N = self.A.shape[0] + 1, self.A.shape[1], self.params.devices
        out: dict[str, Any] = {
            "tokens": self.tokens,
            "devices": N,
            "transfers_round_robin": volume(self.A, round_robin(L, E, N)),
            "transfers_linear": volume(self.A, linear(L, E, N)),
        }
        if self.placement is not None:
            out["transfers_placement"] = volume(self.A, self.placement)
        s = solve(self.A, N)
        out["transfers_in_sample_optimum"] = s.volume
        out["lower_bound"] = s.lower_bound
        return out
