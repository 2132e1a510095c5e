"""`affinity-placement` MoE scheduler (ExFlow): measures, inside vLLM, the cross-device token
transfers that expert parallelism over ``devices`` devices would need under round-robin,
linear and (if given) a computed placement, from the live routing (an ``observe`` step;
changes nothing). The placement itself is computed offline from recorded traces
(``vllm-graft moe-sim TRACE --place-out FILE``; see ``policy.py``) in vLLM's EPLB layout.

On vLLM CPU there is no expert parallelism: the placement is evaluated, not applied.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from vllm_graft.hooks import Capabilities, Registration, hookimpl
from vllm_graft.hooks.deployment import param_path


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    devices: int = Field(4, ge=1, description="expert-parallel devices N")
    placement_file: str | None = Field(None, description="placement JSON (format vllm-graft/expert-placement)")

    @field_validator("placement_file")
    @classmethod
    def _readable(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None:
            return v
        from .policy import Placement

        path = param_path(v, info)
        Placement.load(path)
        return str(path)


@hookimpl
def graft_register_moe_schedulers(register):
    register(Registration(
        name="affinity-placement",
        summary="Counts expert-parallel all-to-all transfers of round-robin/linear/affinity placements from live routing",
        paper="ExFlow: exploiting inter-layer expert affinity for MoE inference",
        params=Params,
        impl="vllm_graft.plugins.moe.affinity_placement.reference:AffinityPlacement",
        capabilities=Capabilities(lossless=True),
    ))
