"""`h2o` KV compressor (Heavy-Hitter Oracle, Zhang et al. 2023, arXiv:2306.14048) at block
granularity: keeps ``sink_blocks`` leading blocks, the ``recent_blocks`` most recent ones
(the block being written included) and, up to ``budget_blocks`` in all, the blocks with the
most attention accumulated so far (summed over every query since the block was written, all
heads and all layers: vLLM frees KV per block and per KV-cache group, not per layer or head).
``score: mean`` ranks blocks by that sum per query that could attend to them instead, removing
the sum's preference for old blocks.

The attention mass comes from the layer's attention itself, which the worker runs through the
scored compressors' shared attention with mass (``kvcompress/_shared``; H2O implements no
``attend``): the exact attention with mass (``kernel: reference``) or the Triton decode kernel
that also emits per-block mass (``kernel: triton``; prefill rows use the reference).
"""

from typing import Literal

from pydantic import Field, model_validator

from ....hooks import Capabilities, PolicyParams, Registration, hookimpl

from .._shared.params import fixed_blocks_fit


class H2OParams(PolicyParams):
    budget_blocks: int = Field(16, ge=2, description="KV blocks a request keeps in all")
    sink_blocks: int = Field(1, ge=0, description="leading blocks always kept")
    recent_blocks: int = Field(1, ge=1, description="most recent blocks always kept (the one being written included)")
    score: Literal["sum", "mean"] = Field(
        "sum",
        description="'sum': a block's attention accumulated over every query since it was "
        "written (H2O); 'mean': that sum divided by the number of those queries, so old blocks "
        "are not favoured for having been attended longer",
    )

    @model_validator(mode="after")
    def _room_for_heavy_hitters(self):
        return fixed_blocks_fit(self, "; the rest of the budget holds the heavy hitters")


@hookimpl
def graft_register_kv_compressors(register):
    register(
        Registration(
            name="h2o",
            summary="H2O: keeps sink + recent blocks and the blocks with the most accumulated attention",
            paper="Zhang et al. 2023, H2O: Heavy-Hitter Oracle for Efficient Generative Inference of LLMs (arXiv:2306.14048)",
            params=H2OParams,
            impl="vllm_graft.plugins.kvcompress.h2o.reference:H2O",
            capabilities=Capabilities(lossless=False, parallelism=("tp", "dp")),
        )
    )
