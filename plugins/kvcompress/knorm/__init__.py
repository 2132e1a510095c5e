"""`knorm` KV compressor (Devoto et al. 2024, "A Simple and Effective L2 Norm-Based Strategy
for KV Cache Compression", arXiv:2406.11430) at block granularity: over ``budget_blocks``,
keep the blocks whose keys have the lowest L2 norm. The paper finds that attention concentrates
on low-norm keys, so the norm predicts attention without computing it; here each block scores
minus its keys' mean norm (over its tokens, KV heads and layers) from the cache itself
(``KVCompressor.block_scores``), re-read each step, and the policy keeps the top blocks as
``tova`` does (the block being written always; ``sink_blocks`` leading ones; nothing
mid-prefill).

The layer's attention itself is the worker's shared attention (``kernel: reference`` or
``triton``); the scores replace its mass.
"""

from pydantic import Field, model_validator

from vllm_graft.hooks import Capabilities, KernelParams, Registration, hookimpl


class KNormParams(KernelParams):
    budget_blocks: int = Field(16, ge=2, description="KV blocks a request keeps in all")
    sink_blocks: int = Field(0, ge=0, description="leading blocks always kept (the paper keeps none)")

    @model_validator(mode="after")
    def _room(self):
        if self.sink_blocks >= self.budget_blocks:
            raise ValueError(
                f"sink_blocks ({self.sink_blocks}) must be smaller than budget_blocks ({self.budget_blocks}): "
                "the block being written is always kept"
            )
        return self


@hookimpl
def graft_register_kv_compressors(register):
    register(
        Registration(
            name="knorm",
            summary="K-norm: keeps the blocks whose keys have the lowest L2 norm",
            paper="Devoto et al. 2024, A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression (arXiv:2406.11430)",
            params=KNormParams,
            impl="vllm_graft.plugins.kvcompress.knorm.reference:KNorm",
            # the worker computes the layer's attention for it, which an attention plugin would replace
            capabilities=Capabilities(lossless=False, incompatible_with=("attention:*",), parallelism=("tp", "dp")),
        )
    )
