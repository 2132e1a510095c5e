"""`expert-mask` MoE scheduler (MoTE): switch given experts off, or force them on, per layer,
by masking the router logits before top-k.

Parameters: ``mask_file`` (a JSON mask, e.g. written by ``vllm-graft calibrate expert-mask``)
and/or inline ``off`` / ``on`` maps ``{layer: [experts]}`` (layer ``"*"``: every layer); both
given: their union. The mask's form is checked when the deployment is validated; whether its
layer and expert indices fit the model (and leave at least top-k experts per layer, at most
top-k forced on) is checked at activation, when the model's layers, ``E`` and top-k are known.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from ....hooks import Capabilities, Registration, hookimpl

from .._shared import loadable_file
from .policy import ExpertMask, MaskError


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mask_file: str | None = Field(
        None,
        description="JSON mask file (format vllm-graft/expert-mask); a relative path is "
        "resolved from the current folder, else from the deployment file's folder",
    )
    off: dict[int | str, list[int]] = Field(
        default_factory=dict, description="layer ('*' = every layer) -> experts switched off"
    )
    on: dict[int | str, list[int]] = Field(
        default_factory=dict, description="layer ('*' = every layer) -> experts forced into the top-k"
    )
    margin: float = Field(
        0.0, ge=0.0, description="how far above the best other expert a forced expert's logit is put (0: just above)"
    )

    @field_validator("mask_file")
    @classmethod
    def _readable(cls, v: str | None, info: ValidationInfo) -> str | None:
        return loadable_file(v, info, ExpertMask.load)  # MaskError (a ValueError) names the problem

    @model_validator(mode="after")
    def _well_formed(self) -> "Params":
        self.inline()  # raises MaskError on a bad layer key or expert index
        return self

    def inline(self) -> ExpertMask:
        return ExpertMask.from_dict({"off": self.off, "on": self.on}, "params")

    def mask(self) -> ExpertMask:
        m = self.inline()
        if self.mask_file is not None:
            m = m.merged(ExpertMask.load(self.mask_file))
        return m


@hookimpl
def graft_register_moe_schedulers(register):
    register(
        Registration(
            name="expert-mask",
            summary="Switches experts off / forces them on per layer by masking router logits before top-k",
            paper="MoTE (tunable experts): detect behaviour-distinctive experts, mask them in the router",
            params=Params,
            impl="vllm_graft.plugins.moe.expert_mask.reference:ExpertMaskScheduler",
            capabilities=Capabilities(parallelism=("tp", "dp"), lossless=False),
        )
    )


__all__ = ["Params", "ExpertMask", "MaskError"]
