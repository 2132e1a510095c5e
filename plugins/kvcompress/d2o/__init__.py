"""`d2o` KV compressor (D2O, Wan et al. 2024, "D2O: Dynamic Discriminative Operations for
Efficient Long-Context Inference of Large Language Models", arXiv:2406.13035) at block
granularity: merge-on-evict.

Eviction alone loses what the evicted tokens held. D2O evicts by accumulated attention (as H2O)
and then looks at each evicted token again: if its key is close enough to a kept token's key
(cosine similarity at least a threshold that follows the similarities seen so far, an
exponential moving average), its key and value are **merged** into that kept token's instead of
dropped, with weights that grow with the similarity.

Here: the blocks to evict are H2O's (sink + recent blocks, the rest of ``budget_blocks`` by
accumulated mass: H2O's scorer under the keep policy, ``hooks.contracts.kvpolicy``),
so vLLM frees exactly as many blocks as with ``h2o``. Before they are freed, the worker hands
each layer's evicted and kept K/V to :meth:`~.reference.D2O.merge` (the contract's
``KVCompressor.merge``): every evicted token, per KV head, finds its most similar kept token;
if the similarity is at least the threshold, the kept token's key and value become the
weighted mean of itself (weight ``e``, its similarity to itself being 1) and the tokens merged
into it (weight ``exp(similarity)``). The threshold is per request, layer and KV head: the
first eviction's mean best similarity, then ``ema`` x the previous threshold + (1 - ema) x this
eviction's mean best similarity. ``threshold`` fixes it instead.

Where it departs from the paper: blocks are evicted whole (vLLM frees KV per block), the
eviction budget is the same for every layer (D2O's per-layer budgets only mask on vLLM, as
``pyramidkv`` shows), and keys are merged as cached, with their positions applied (the
paper's cache holds the same).

On vLLM a merged block's content no longer matches its tokens' hash, so a ``d2o`` request
never shares prefix-cache blocks, with plain vLLM or with another ``d2o`` request (each request
is salted on its own).
"""

from pydantic import Field

from ....hooks import Capabilities, Registration, hookimpl

from ..h2o import H2OParams


class D2OParams(H2OParams):
    """H2O's parameters (the same blocks are dropped) and the merge's threshold."""

    threshold: float | None = Field(
        None,
        ge=-1.0,
        le=1.0,
        description="merge an evicted token when its key's cosine similarity to the nearest kept key is at "
        "least this; None: D2O's running threshold (see ema)",
    )
    ema: float = Field(
        0.5,
        ge=0.0,
        lt=1.0,
        description="running threshold = ema x previous + (1 - ema) x this eviction's mean best similarity",
    )


@hookimpl
def graft_register_kv_compressors(register):
    register(
        Registration(
            name="d2o",
            summary="D2O: evicts as H2O, then merges each evicted token into its most similar kept token",
            paper="Wan et al. 2024, D2O: Dynamic Discriminative Operations for Efficient Long-Context "
            "Inference of Large Language Models (arXiv:2406.13035)",
            params=D2OParams,
            impl="vllm_graft.plugins.kvcompress.d2o.reference:D2O",
            # tp: its scores are summed over the ranks' KV heads (tests/e2e/test_tensor_parallel.py)
            capabilities=Capabilities(lossless=False, parallelism=("tp", "dp")),
        )
    )
