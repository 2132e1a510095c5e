"""`pyramidkv` KV compressor (PyramidKV, Cai et al. 2024, "PyramidKV: Dynamic KV Cache Compression
based on Pyramidal Information Funneling", arXiv:2406.02069) at block granularity: SnapKV's
observation-window scores, kept separately for each decoder layer, and a budget per layer that
falls from the first layer to the last (lower layers attend broadly, upper layers to a few
blocks: the paper's "pyramidal funneling").

Once the prompt is prefilled, layer l keeps the ``sink_blocks`` leading blocks, the observation
window's blocks, the ``recent_blocks`` last prompt blocks, every generated block, and its own best
prompt blocks by the mass its window queries put on them, ``budget_blocks`` on average over the
layers: ``min_fraction`` of the average at the last layer, ``2 - min_fraction`` of it at the
first, linear in between.

**What it frees on vLLM.** vLLM frees a KV block for every layer at once (one KV-cache group), so a
block is freed only when no layer keeps it: the blocks a request holds are the union of the
layers' choices (at least the first layer's larger budget), and inside them each layer attends
only to the blocks it chose (per-layer masking). The paper's saving, fewer tokens in the upper
layers at the same total, is a memory saving only where each layer's cache is sized on its own;
here the upper layers' smaller budgets save reads, not memory. ``held_blocks`` caps the union
(the memory a request holds): the chosen blocks with the best scores are held, and each layer
then reads its own best among them. Mid-prefill nothing is dropped.
"""

from pydantic import Field, model_validator

from ....hooks import Capabilities, Registration, hookimpl
from .._shared.params import held_blocks_field, held_blocks_fit
from ..snapkv import SnapKVParams


class PyramidKVParams(SnapKVParams):
    budget_blocks: int = Field(
        16,
        ge=2,
        description="prompt KV blocks each layer keeps after prefill, on average over the layers",
    )
    min_fraction: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description="the last layer's budget as a fraction of the average (the first layer's is 2 - this); "
        "1: every layer the same (SnapKV per layer)",
    )
    held_blocks: int | None = held_blocks_field("layer")

    @model_validator(mode="after")
    def _cap_fits_budget(self):
        return held_blocks_fit(self, "the layers keep")


@hookimpl
def graft_register_kv_compressors(register):
    register(
        Registration(
            name="pyramidkv",
            summary="PyramidKV: SnapKV scores per layer, budgets falling from the first layer to the last; "
            "blocks freed where no layer keeps them, per-layer masking inside",
            paper="Cai et al. 2024, PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information "
            "Funneling (arXiv:2406.02069)",
            params=PyramidKVParams,
            impl="vllm_graft.plugins.kvcompress.pyramidkv.reference:PyramidKV",
            # tp: its scores are summed over the ranks' KV heads (tests/e2e/test_tensor_parallel.py)
            capabilities=Capabilities(lossless=False, parallelism=("tp", "dp")),
        )
    )
