"""`slim-llm`: salience-driven mixed-precision group quantisation (SliM-LLM, Huang et al. 2024).

Each row of a weight is cut into groups of ``group_size`` input columns; every group gets its
own bit-width, ``bits - spread``, ``bits`` or ``bits + spread``, from its salience: the most
salient groups of a row are raised and as many of the least salient lowered, so the row holds
exactly ``bits`` bits per weight on average. Each group is quantised uniformly and
asymmetrically (fp16 step, integer zero point) at its width. The salience, the allocation and
how they differ from the paper: ``reference.py``. Written offline by ``vllm-graft quantize
slim-llm --bits 3 MODEL OUT`` (calibrated on the bundled corpus) or applied online, uncalibrated.
Reference (PyTorch) path only: there is no mixed-width Triton GEMM yet.
"""

from typing import Literal

from pydantic import Field, model_validator

from ....hooks import Capabilities, Params, Registration, hookimpl


class SliMLLMParams(Params):
    bits: int = Field(
        3,
        ge=2,
        le=7,
        description="average bits per weight (exact in every row): groups get bits-spread, bits or bits+spread",
    )
    group_size: int = Field(
        128,
        ge=8,
        le=4096,
        multiple_of=8,
        description="input columns per group (a multiple of 8; a shorter last group of a row stays at `bits`)",
    )
    spread: int = Field(
        1,
        ge=0,
        le=3,
        description="the allocation's bit choices: bits-spread, bits, bits+spread (0: uniform `bits`, no mixing)",
    )
    raised_fraction: float | None = Field(
        None,
        ge=0.0,
        le=0.5,
        description=(
            "fraction of a row's full groups raised to bits+spread (as many lowered to bits-spread); "
            "None: the count is searched per row, the one with the least salience-weighted error"
        ),
    )
    calibration: Literal["activations", "gradients", "none"] = Field(
        "activations",
        description=(
            "what weighs salience and error (quantize command; online quantisation has no calibration "
            "and uses 'none'): 'activations' the mean squared input activation per channel "
            "(diag(X^T X)/T), 'gradients' the squared gradients (diagonal Fisher), 'none' weights only"
        ),
    )
    calibration_tokens: int = Field(
        4096,
        ge=64,
        le=1_000_000,
        description="calibration tokens (quantize command; windows of 256)",
    )

    @model_validator(mode="after")
    def _widths(self):
        lo, hi = self.bits - self.spread, self.bits + self.spread
        if lo < 1 or hi > 8:
            raise ValueError(
                f"spread {self.spread} with bits {self.bits} gives widths {lo}..{hi}; they must lie in "
                f"1..8 (spread <= {min(self.bits - 1, 8 - self.bits)} for bits {self.bits})"
            )
        return self


@hookimpl
def graft_register_quant_methods(register):
    register(
        Registration(
            name="slim-llm",
            summary="Salience-driven mixed precision: per-group bit-widths (bits-1/bits/bits+1) at an exact average",
            paper="Huang et al. 2024, SliM-LLM: Salience-Driven Mixed-Precision Quantization for LLMs, arXiv:2405.14917",
            params=SliMLLMParams,
            impl="vllm_graft.plugins.quant.slim_llm.reference:SliMLLM",
            # tp not declared: stored like squeezellm's, but never run under tensor parallelism here
            capabilities=Capabilities(parallelism=("dp",), lossless=False, dtypes=("float16", "bfloat16", "float32")),
        )
    )
