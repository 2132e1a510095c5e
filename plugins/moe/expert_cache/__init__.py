"""`expert-cache` MoE scheduler (ExpertFlow / EdgeMoE): an expert residency policy run on the
live routing inside vLLM (an ``observe`` step; changes nothing): every MoE layer holds
``capacity`` of its ``E`` experts, and the plugin reports the hit rate and the bytes that
loading missed (and prefetched) experts would move per token. ``policy.py`` holds the cache;
``vllm-graft moe-sim TRACE`` runs the same policies on recorded traces.

What this does not do on vLLM CPU: move weights. All experts stay in host memory; the cache
decides and counts, which is what the hit rate and bytes figures measure.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ....hooks import Capabilities, Registration, hookimpl


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    capacity: int | None = Field(None, ge=1, description="experts resident per layer (default: E/4, at least top-k)")
    policy: Literal["lru", "lfu", "affinity"] = Field(
        "affinity", description="eviction policy; affinity = LRU + prefetch of the next layer's likely experts"
    )
    prefetch: int = Field(1, ge=0, description="experts prefetched per layer and token (policy affinity)")
    expert_bytes: int | None = Field(
        None, ge=1, description="bytes of one expert's weights; when given, bytes moved per token are reported too"
    )

    @model_validator(mode="after")
    def _prefetch(self) -> "Params":
        if self.policy == "affinity" and self.prefetch < 1:
            raise ValueError("policy 'affinity' prefetches: prefetch must be at least 1 (or use policy 'lru')")
        if self.capacity is not None and self.policy == "affinity" and self.prefetch > self.capacity:
            raise ValueError(f"prefetch {self.prefetch} is more than the capacity {self.capacity}")
        return self


@hookimpl
def graft_register_moe_schedulers(register):
    register(
        Registration(
            name="expert-cache",
            summary="Expert residency (LRU/LFU/affinity prefetch) for offloaded experts: live hit rate and bytes moved",
            paper="ExpertFlow (adaptive expert scheduling) / EdgeMoE (expert offloading with preloading)",
            params=Params,
            impl="vllm_graft.plugins.moe.expert_cache.reference:ExpertCacheScheduler",
            capabilities=Capabilities(parallelism=("tp", "dp"), lossless=True),
        )
    )
