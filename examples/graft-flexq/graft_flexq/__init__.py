"""`flexq`: FlexQ-style INT6 weights with INT8 (or INT6) activations, a vllm-graft quant plugin.

Made with `vllm-graft new-plugin quant flexq` (see docs/tutorial.md in vllm-graft), then
filled in: the registration and parameters here, the algorithm in reference.py, its Triton
GEMM in kernel.py.
"""
from pydantic import ConfigDict, Field

from vllm_graft.hooks import Capabilities, KernelParams, Registration, hookimpl


class Params(KernelParams):
    """`weight_bits`: uniform symmetric weight bits per output channel (FlexQ: 6).
    `act_bits`: symmetric per-token activation bits (FlexQ keeps 8 in sensitive layers and
    uses 6 elsewhere; here one value for every layer)."""

    model_config = ConfigDict(extra="forbid")

    weight_bits: int = Field(6, ge=2, le=8, description="weight bits (uniform, per output channel)")
    act_bits: int = Field(8, ge=2, le=8, description="activation bits (per token)")


@hookimpl
def graft_register_quant_methods(register):
    register(Registration(
        name="flexq",
        summary="INT6 weights per output channel with INT8 per-token activations (W6A8)",
        paper="FlexQ: Efficient Post-training INT6 Quantization for LLM Serving via "
              "Algorithm-System Co-Design (2025)",
        params=Params,
        impl="graft_flexq.reference:FlexQ",
        capabilities=Capabilities(lossless=False, platforms=("cpu", "cuda"),
                                  dtypes=("float32", "float16", "bfloat16")),
    ))
