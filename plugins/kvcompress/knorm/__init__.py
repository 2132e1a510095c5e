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

from ....hooks import Capabilities, Registration, hookimpl

from .._shared.params import TopBlocksParams


@hookimpl
def graft_register_kv_compressors(register):
    register(
        Registration(
            name="knorm",
            summary="K-norm: keeps the blocks whose keys have the lowest L2 norm",
            paper="Devoto et al. 2024, A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression (arXiv:2406.11430)",
            params=TopBlocksParams,
            impl="vllm_graft.plugins.kvcompress.knorm.reference:KNorm",
            # tp: its scores are summed over the ranks' KV heads (tests/e2e/test_tensor_parallel.py)
            capabilities=Capabilities(lossless=False, parallelism=("tp", "dp")),
        )
    )
