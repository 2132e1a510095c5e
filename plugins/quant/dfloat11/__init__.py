"""`dfloat11`: lossless compression of bf16 weights (DFloat11, Zhang et al. 2025).

A bf16 weight's 8 exponent bits carry ~2.5-3 bits of information in trained (or fp16-derived)
weights: they are Huffman-coded; sign and 7 mantissa bits are kept raw. Before every matmul
the layer decodes its exponents back to the exact bf16 weight, so outputs are bit-identical
to computing with the bf16 weight. Pre-quantised checkpoints only make sense here (online it
saves memory but gains nothing on load); see ``vllm-graft quantize dfloat11``.
"""

from typing import Literal

from pydantic import Field

from ....hooks import Capabilities, KernelParams, Registration, hookimpl


class DFloat11Params(KernelParams):
    """`kernel: triton` runs the Triton kernels (GPU, or the interpreter with TRITON_INTERPRET=1);
    `reference` (the default) the torch path."""

    chunk: int = Field(
        128,
        ge=16,
        le=4096,
        description=(
            "symbols per independently decodable chunk: the decoder runs all chunks in parallel, "
            "`chunk` steps each; each chunk costs a 32-bit start offset (32/chunk bits per weight)"
        ),
    )
    max_code_len: int = Field(
        12,
        ge=8,
        le=16,
        description=("longest Huffman code in bits (the decoder's lookup table has 2**max_code_len entries)"),
    )
    cpu_decoder: Literal["cpp", "torch"] = Field(
        "cpp",
        description=(
            "the CPU path (kernel: reference): 'cpp' decodes with a C++ loop built on first use by "
            "torch's extension loader (needs a C++ compiler, as vLLM's CPU engine does; cached "
            "once built; where it cannot be built the log says why and 'torch' runs); 'torch' "
            "decodes with the vectorised torch loop of `chunk` steps (~10x slower). Same weights "
            "either way"
        ),
    )


@hookimpl
def graft_register_quant_methods(register):
    register(
        Registration(
            name="dfloat11",
            summary="Lossless: Huffman-coded bf16 exponents, decoded before each matmul",
            paper="Zhang et al. 2025, 70% Size, 100% Accuracy: Lossless LLM Compression via "
            "Dynamic-Length Float (DFloat11), arXiv:2504.11651",
            params=DFloat11Params,
            impl="vllm_graft.plugins.quant.dfloat11.reference:DFloat11",
            capabilities=Capabilities(parallelism=("tp", "dp"), lossless=True, dtypes=("bfloat16",)),
        )
    )
