"""`adakv` KV compressor (Ada-KV, Feng et al. 2024, arXiv:2407.11550) at block granularity, per
KV head: SnapKV's observation-window scores, kept separately for each KV head, and AdaKV's
adaptive allocation of one budget across the heads.

Once the prompt is prefilled, every KV head keeps the ``sink_blocks`` leading blocks, the
blocks of the observation window (the last ``window_tokens`` prompt tokens) and of the
``recent_blocks`` last prompt blocks, and every generated block (as ``snapkv``). The other prompt
blocks are shared out: ``budget_blocks`` is a head's *average* budget of prompt blocks, so the
heads have ``H_kv x (budget_blocks - fixed blocks)`` (head, block) slots in all, taken by score
over all heads together (a head whose window attention is concentrated on a few blocks takes
few, a diffuse head many) after each head's ``floor_fraction`` share of its even budget (the
paper's safeguard). A head's score of a block is the mass its query heads' window queries put
on it, summed over layers (vLLM frees a block for every layer at once).

Memory. vLLM frees KV per block for every head together, so a block is freed only when no head
keeps it: the blocks held are the union of the heads' choices (up to ``H_kv x`` a head's
budget), and inside them each head attends only to the blocks it chose (per-head masking).
``held_blocks`` caps that union at a number of prompt blocks (the memory a request holds, as
``snapkv``'s ``budget_blocks``): a pair that would open a block no head holds yet is skipped
once the cap is reached. With ``held_blocks`` = ``budget_blocks`` every slot fits in the cap, so
the heads share the union (AdaKV's choice of blocks, no masking); below, the heads read
``budget_blocks`` of the ``held_blocks`` on average. Mid-prefill nothing is dropped.
"""

from pydantic import Field, model_validator

from ....hooks import Capabilities, Registration, hookimpl
from .._shared.params import held_blocks_field, held_blocks_fit
from ..snapkv import SnapKVParams


class AdaKVParams(SnapKVParams):
    budget_blocks: int = Field(
        16,
        ge=2,
        description="prompt KV blocks each KV head keeps after prefill, on average "
        "(the heads' budget, H_kv x budget_blocks (head, block) slots, is allocated by score)",
    )
    floor_fraction: float = Field(
        0.2,
        ge=0.0,
        le=1.0,
        description="share of its even budget each head gets "
        "before the rest is allocated by score over all heads (AdaKV's safeguard)",
    )
    held_blocks: int | None = held_blocks_field("head", ", up to H_kv x budget_blocks")

    @model_validator(mode="after")
    def _cap_fits_budget(self):
        return held_blocks_fit(self, "a head keeps")


@hookimpl
def graft_register_kv_compressors(register):
    register(
        Registration(
            name="adakv",
            summary="Ada-KV: SnapKV scores per KV head, one prompt budget allocated across heads by score; "
            "blocks freed where no head keeps them, per-head masking inside",
            paper="Feng et al. 2024, Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for "
            "Efficient LLM Inference (arXiv:2407.11550)",
            params=AdaKVParams,
            impl="vllm_graft.plugins.kvcompress.adakv.reference:AdaKV",
            # tensor parallelism: the ranks' per-head mass is gathered, so every rank allocates
            # over all KV heads and masks its own. What it cannot be combined with follows from
            # its class's shape (per_head: no storage format; needs_scores: no attention plugin)
            capabilities=Capabilities(lossless=False, parallelism=("tp", "dp")),
        )
    )
