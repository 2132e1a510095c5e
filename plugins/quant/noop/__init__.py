"""`noop` quantization: keeps weights in full precision."""
from vllm_graft.hooks import Capabilities, NoParams, Registration, hookimpl


@hookimpl
def graft_register_quant_methods(register):
    register(Registration(
        name="noop",
        summary="Keeps weights unquantised (the full-precision baseline)",
        paper="-",
        params=NoParams,
        impl="vllm_graft.plugins.quant.noop.reference:FullPrecision",
        capabilities=Capabilities(lossless=True),
    ))
