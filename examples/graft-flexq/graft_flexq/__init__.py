"""`flexq`: a vllm-graft quant plugin (registration and parameters)."""
from pydantic import Field

from vllm_graft.hooks import Capabilities, KernelParams, Registration, hookimpl


class Params(KernelParams):
    """Parameters, as written under `params:` in a deployment. Give every field a type,
    a default and bounds (Field(..., ge=...)): the conformance kit checks that bad values
    are refused. `kernel` (from KernelParams) picks 'reference' or 'triton'."""

    example: int = Field(1, ge=1, description="replace with your parameters")


@hookimpl
def graft_register_quant_methods(register):
    register(Registration(
        name="flexq",
        summary="One line: what it does",
        paper="The paper's title (venue or arXiv id)",
        params=Params,
        impl="graft_flexq.reference:Flexq",
        capabilities=Capabilities(lossless=False, platforms=("cpu", "cuda")),
    ))
