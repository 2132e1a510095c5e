"""`squeezellm`: dense-and-sparse non-uniform quantisation (SqueezeLLM, Kim et al. 2024).

Per output channel, a 2**bits-entry look-up table found by k-means weighted by each weight's
sensitivity (the squared gradient of the loss on calibration text, a diagonal Fisher
estimate); the weight stores ``bits``-bit indices into it. Outliers (largest magnitudes)
and the most sensitive weights are kept exactly (fp16) in a sparse CSR matrix added to the
dense product. Written offline by ``vllm-graft quantize squeezellm --bits 3|4 MODEL OUT``.
"""

from typing import Literal

from pydantic import Field

from ....hooks import Capabilities, KernelParams, Registration, hookimpl


class SqueezeLLMParams(KernelParams):
    """`kernel: triton` runs the Triton kernels (GPU, or the interpreter with TRITON_INTERPRET=1);
    `reference` (the default) the torch path."""

    bits: Literal[3, 4] = Field(4, description="bits per dense weight: a 2**bits-entry LUT per output channel")
    cpu_weights: Literal["indices", "packed"] = Field(
        "indices",
        description=(
            "the torch path (kernel: reference): 'indices' keeps each weight's LUT index as a byte, "
            "unpacked once at load (+1 byte per weight beside the bit planes), and gathers the dense "
            "weight from it per call; 'packed' keeps the bit planes only and unpacks them on every "
            "call (~30x slower). Same results either way"
        ),
    )
    cpu_dequant: Literal["cpp", "torch"] = Field(
        "cpp",
        description=(
            "with cpu_weights 'indices': 'cpp' builds the dense weight with a C++ loop (built on first "
            "use by torch's extension loader; needs a C++ compiler, as vLLM's CPU engine does; where "
            "it cannot be built the log says why and 'torch' runs); 'torch' gathers it with "
            "lut.gather (~6x slower). Same results either way"
        ),
    )
    outliers: float = Field(
        0.004,
        ge=0.0,
        le=0.1,
        description=("fraction of each weight matrix kept exactly in the sparse part: largest magnitudes"),
    )
    sensitive: float = Field(
        0.0005,
        ge=0.0,
        le=0.1,
        description=("fraction kept exactly in the sparse part: the most sensitive weights (largest squared gradient)"),
    )
    kmeans_iters: int = Field(25, ge=1, le=200, description="weighted k-means iterations per layer")
    calibration_tokens: int = Field(
        8192,
        ge=64,
        le=1_000_000,
        description=("calibration tokens for the sensitivities (quantize command; windows of 256)"),
    )


@hookimpl
def graft_register_quant_methods(register):
    register(
        Registration(
            name="squeezellm",
            summary="Dense-and-sparse: sensitivity-weighted k-means LUT per channel + fp16 sparse outliers",
            paper="Kim et al. 2024, SqueezeLLM: Dense-and-Sparse Quantization, arXiv:2306.07629",
            params=SqueezeLLMParams,
            impl="vllm_graft.plugins.quant.squeezellm.reference:SqueezeLLM",
            capabilities=Capabilities(parallelism=("tp", "dp"), lossless=False, dtypes=("float16", "float32")),
        )
    )
