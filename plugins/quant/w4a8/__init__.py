"""`w4a8`: QServe's progressive group quantisation (Lin et al. 2024, QoQ W4A8KV4, weights
and activations part).

Weights: per output channel, symmetric int8 with a "protective range" of +-119 and an fp16
step; then per group of ``group_size`` input columns, asymmetric 4-bit of those int8 values
with an integer multiplier (int8) and a 4-bit zero point, so that dequantising int4 -> int8,
``(q4 - zero) * multiplier``, stays in int8 and needs no floating point. Activations:
symmetric int8 per token. The GEMM multiplies int8 by int8 into int32 and scales once by
``token step * channel step``. Written offline by ``vllm-graft quantize w4a8 MODEL OUT``.
"""

from typing import Literal

from pydantic import Field

from ....hooks import Capabilities, KernelParams, Registration, hookimpl


class W4A8Params(KernelParams):
    """`kernel: triton` runs the Triton kernels (GPU, or the interpreter with TRITON_INTERPRET=1);
    `reference` (the default) the torch path."""

    group_size: int = Field(
        128,
        ge=8,
        le=4096,
        description=("input columns per 4-bit group (a multiple of 2; the last group of a row may be shorter)"),
    )
    cpu_weights: Literal["int8", "packed"] = Field(
        "int8",
        description=(
            "the torch path (kernel: reference): 'int8' keeps each weight's int8 values, unpacked once "
            "at load (+1 byte per weight beside the 0.5 of the 4-bit codes), and multiplies int8 by "
            "int8 into int32 (torch._int_mm); 'packed' keeps the 4-bit codes only and unpacks them on "
            "every call (~100x slower). Same results either way"
        ),
    )


@hookimpl
def graft_register_quant_methods(register):
    register(
        Registration(
            name="w4a8",
            summary="QServe progressive W4A8: int4 weights dequantised to int8, int8 per-token activations",
            paper="Lin et al. 2024, QServe: W4A8KV4 Quantization and System Co-design, arXiv:2405.04532",
            params=W4A8Params,
            impl="vllm_graft.plugins.quant.w4a8.reference:W4A8",
            capabilities=Capabilities(parallelism=("tp", "dp"), lossless=False, dtypes=("float16", "float32")),
        )
    )
