"""`keydiff` KV compressor (Park et al. 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction
for Long-Context LLM Inference in Resource-Constrained Environments", arXiv:2504.15364) at block
granularity: over ``budget_blocks``, keep the blocks whose keys differ most from the rest.
KeyDiff scores each key by its cosine similarity to an anchor (the mean key) and evicts the most
similar: distinct keys carry information the others do not, and no attention is needed. Here a
block scores minus its keys' mean cosine similarity to the sequence's anchor key (per KV head,
averaged over heads; summed over layers), read from the cache each step
(``KVCompressor.block_scores``); the policy keeps the top blocks as ``tova`` does.

The layer's attention itself is the worker's shared attention (``kernel: reference`` or
``triton``); the scores replace its mass.
"""

from ....hooks import Capabilities, Registration, hookimpl

from .._shared.params import TopBlocksParams


@hookimpl
def graft_register_kv_compressors(register):
    register(
        Registration(
            name="keydiff",
            summary="KeyDiff: keeps the blocks whose keys differ most from the sequence's mean key",
            paper="Park et al. 2025, KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM "
            "Inference in Resource-Constrained Environments (arXiv:2504.15364)",
            params=TopBlocksParams,
            impl="vllm_graft.plugins.kvcompress.keydiff.reference:KeyDiff",
            # tp: its scores are summed over the ranks' KV heads (tests/e2e/test_tensor_parallel.py)
            capabilities=Capabilities(lossless=False, parallelism=("tp", "dp")),
        )
    )
