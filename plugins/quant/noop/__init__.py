"""`noop` quantization: keeps weights in full precision."""

from pydantic import Field

from ....hooks import Capabilities, Params, Registration, hookimpl


class FullPrecisionParams(Params):
    host_gemm: bool = Field(
        True,
        description=(
            "Compute each layer with the host engine's own dense GEMM (vLLM's unquantised linear "
            "method: prepacked oneDNN on CPU), so the noop costs nothing. false: through "
            "vllm-graft's opaque op and F.linear, the route every other quant plugin takes; use it "
            "to measure what that route costs"
        ),
    )


@hookimpl
def graft_register_quant_methods(register):
    register(
        Registration(
            name="noop",
            summary="Keeps weights unquantised (the full-precision baseline)",
            paper="-",
            params=FullPrecisionParams,
            impl="vllm_graft.plugins.quant.noop.reference:FullPrecision",
            capabilities=Capabilities(parallelism=("tp", "dp"), lossless=True),
        )
    )
