"""`expected-attention` KV compressor (Expected Attention, Devoto, Jeblick and Jégou 2025,
"KV Cache Compression by Estimating Attention from Future Queries Distribution",
arXiv:2510.00636) at block granularity.

The paper models the queries still to come as a Gaussian, ``q ~ N(mu, Sigma)``, estimated from
recent queries, and scores each key by the attention it should expect from them in closed form:
``E[exp(q.k / sqrt(d))] = exp(mu.k / sqrt(d) + k' Sigma k / (2 d))``, normalised over the keys
(a softmax) and weighted by the value's norm (how much the pair moves the residual stream).

Here, once the prompt is prefilled (as ``snapkv``, whose parameters it shares): ``mu`` and a
diagonal ``Sigma`` per query head are estimated from the prompt's last ``window_tokens``
queries, every key of the sequence is scored, a block's score is the sum over its tokens, KV
heads and layers, and the prompt blocks with the highest scores stay (``budget_blocks`` of them,
or ``keep_ratio`` of the prompt), with the window's own blocks, ``sink_blocks`` leading and
``recent_blocks`` last ones; generated blocks are all kept. Where it departs from the paper: the
covariance is diagonal (``D`` numbers per head, not ``D x D``); the statistics are those of the
window's queries as rotated at their own positions (the paper averages the rotation over the
next positions); the unit is vLLM's block (it frees KV per block, for every layer and head).

No attention mass is needed: the worker runs the shared attention (or, on CUDA, vLLM's own
kernel for the steps that observe nothing) and hands this compressor the step's queries with
the cache (``block_scores``).
"""

from pydantic import Field

from ....hooks import Capabilities, Registration, hookimpl
from ..snapkv import SnapKVParams


class ExpectedAttentionParams(SnapKVParams):
    use_vnorm: bool = Field(
        True, description="weight each key's expected attention by its value's L2 norm (the paper's)"
    )


@hookimpl
def graft_register_kv_compressors(register):
    register(
        Registration(
            name="expected-attention",
            summary="Expected Attention: keeps the prompt blocks that future queries (a Gaussian fitted to the "
            "window's queries) are expected to attend to most, weighted by value norm",
            paper="Devoto, Jeblick and Jégou 2025, Expected Attention: KV Cache Compression by Estimating "
            "Attention from Future Queries Distribution (arXiv:2510.00636)",
            params=ExpectedAttentionParams,
            impl="vllm_graft.plugins.kvcompress.expected_attention.reference:ExpectedAttention",
            # tp: its scores are summed over the ranks' KV heads (tests/e2e/test_tensor_parallel.py)
            capabilities=Capabilities(lossless=False, parallelism=("tp", "dp")),
        )
    )
