"""`route-trace` MoE scheduler: records every MoE layer's routing (top-k ids and weights)
into a :class:`~.reference.Trace` (an ``observe`` step; changes nothing).

Put it last in the ``moe:`` list to record what the layers compute with after every other
plugin. ``path``: where the trace is written when the process exits (and by ``save()``);
without it the trace stays in memory, for in-process tools (``vllm-graft moe-trace``,
``calibrate``) that read it from the plugin instance.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ....hooks import Capabilities, Registration, hookimpl


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str | None = Field(None, description="write the trace here (.npz) when the process exits")
    weights: bool = Field(True, description="record the routing weights too (float16)")
    max_tokens: int = Field(2_000_000, ge=1, description="stop recording after this many tokens")

    @field_validator("path")
    @classmethod
    def _npz(cls, v: str | None) -> str | None:
        if v is not None and not v.endswith(".npz"):
            raise ValueError(f"the trace file must end in .npz (got {v!r})")
        return v


@hookimpl
def graft_register_moe_schedulers(register):
    register(
        Registration(
            name="route-trace",
            summary="Records every MoE layer's top-k expert ids and weights to a compact .npz trace",
            paper="- (the routing traces ExFlow / ExpertFlow-style simulations run on)",
            params=Params,
            impl="vllm_graft.plugins.moe.route_trace.reference:RouteTrace",
            capabilities=Capabilities(parallelism=("tp", "dp"), lossless=True),
        )
    )
