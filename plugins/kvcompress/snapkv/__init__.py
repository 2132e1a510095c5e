"""`snapkv` KV compressor (SnapKV, Li et al. 2024, arXiv:2404.14469) at block granularity:
once the prompt is prefilled, keep the prompt blocks that the last ``window_tokens`` prompt
tokens (the observation window) attend to most, the blocks holding the window itself and
``sink_blocks`` leading blocks and the ``recent_blocks`` last prompt blocks, ``budget_blocks``
prompt blocks in all; blocks of generated tokens are all kept (SnapKV compresses the prompt,
not the generation). ``recent_blocks`` (0 in the paper, where the window is all that is kept
of the prompt's end) keeps local context that the window's attention does not single out.

Scores are aggregated, not per layer or per head: vLLM frees KV per block and per KV-cache
group, so a block is kept or freed for every layer and head at once; its score is the
attention mass the window's queries put on it, summed over heads and layers. (The paper's
per-head selection and 1-D pooling of scores are left out: the block already pools 16-128
adjacent tokens.) Mid-prefill (chunked prefill) nothing is dropped.
"""

from pydantic import Field, model_validator

from ....hooks import Capabilities, PolicyParams, Registration, hookimpl

from .._shared.params import fixed_blocks_fit, sinks_leave_room


class SnapKVParams(PolicyParams):
    budget_blocks: int = Field(16, ge=2, description="prompt KV blocks a request keeps after prefill")
    window_tokens: int = Field(
        32, ge=1, description="observation window: the last prompt tokens whose attention scores the prompt"
    )
    sink_blocks: int = Field(1, ge=0, description="leading blocks always kept")
    recent_blocks: int = Field(
        0,
        ge=0,
        description="last prompt blocks always kept, besides those of the "
        "observation window (0: only the window's, as in the paper)",
    )

    @model_validator(mode="after")
    def _room(self):
        return fixed_blocks_fit(sinks_leave_room(self, "the observation window needs a block"))

    def check_deployment(self, ctx) -> list[str]:
        """At deployment validation (``DeploymentContext``): the observation window's blocks are
        always kept, so with the sink they must fit in the budget (else a request would hold
        more than ``budget_blocks`` prompt blocks)."""
        if ctx.block_size is None or self.keep_ratio is not None:
            return []  # with keep_ratio the budget comes from each prompt's length
        # W consecutive tokens lie in at most ceil((W - 1) / B) + 1 blocks (one more when not aligned)
        spans = -(-(self.window_tokens - 1) // ctx.block_size) + 1
        if self.sink_blocks + spans <= self.budget_blocks:
            return []
        # a window that fits: k whole blocks span at most k + 1; with no block to spare, 1 token
        most = max(1, (self.budget_blocks - self.sink_blocks - 1) * ctx.block_size)
        return [
            f"window_tokens {self.window_tokens} spans up to {spans} KV blocks of {ctx.block_size} tokens "
            f"(engine.block_size, else vLLM's default on {ctx.platform}), which SnapKV always keeps: with "
            f"sink_blocks {self.sink_blocks} that exceeds budget_blocks {self.budget_blocks}; set "
            f"window_tokens to at most {most} or budget_blocks to at least {self.sink_blocks + spans}"
        ]


@hookimpl
def graft_register_kv_compressors(register):
    register(
        Registration(
            name="snapkv",
            summary="SnapKV: after prefill, keeps the prompt blocks the observation window attends to most",
            paper="Li et al. 2024, SnapKV: LLM Knows What You are Looking for Before Generation (arXiv:2404.14469)",
            params=SnapKVParams,
            impl="vllm_graft.plugins.kvcompress.snapkv.reference:SnapKV",
            capabilities=Capabilities(lossless=False, parallelism=("tp", "dp")),
        )
    )
