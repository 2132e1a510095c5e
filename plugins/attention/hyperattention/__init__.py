"""`hyperattention`: approximate long-prompt prefill attention (Han et al., "HyperAttention:
Long-context Attention in Near-Linear Time", arXiv:2310.05343).

A prefill whose context holds at least ``min_seq_len`` tokens is attended approximately: queries
and keys are hashed by an angular LSH (``lsh_bits`` random hyperplanes, the codes ordered as a
Gray code so that neighbouring buckets differ in one bit) and sorted by it; attention is exact
inside blocks of ``block_size`` keys of the sorted order (block-diagonal after sorting), and the
rest is estimated from ``sample_size`` uniformly sampled keys, rescaled; the two parts merge by
their softmax denominators. Causal masking follows the paper's recursive split: the lower-left
(unmasked) quarter is approximated, the two diagonal halves recurse until shorter than
``min_seq_len``, where they are exact. A chunk of a chunked prefill attends approximately to the
cached prefix (unmasked) and by the recursion to itself. Decode steps and shorter prompts get
exact attention. Hashes and samples are seeded (``seed``): runs are reproducible.
"""

from pydantic import Field

from ....hooks import Capabilities, Params, Registration, hookimpl
from ....hooks.registry import ATTENTION_BACKEND_LIMITS


class HyperAttentionParams(Params):
    min_seq_len: int = Field(
        4096,
        ge=2,
        description="a prefill is approximated when its context (cached prefix plus this chunk) "
        "holds at least this many tokens; the causal recursion's diagonal pieces shorter than this "
        "are exact. Shorter prompts and decode steps get exact attention",
    )
    block_size: int = Field(256, ge=1, le=65536, description="keys per block of the LSH-sorted order, attended exactly")
    sample_size: int = Field(
        256,
        ge=0,
        le=65536,
        description="keys sampled uniformly (without replacement) per KV head for the residual "
        "outside the blocks, their contribution scaled by keys / samples; 0: blocks only",
    )
    lsh_bits: int = Field(7, ge=1, le=30, description="random hyperplanes of the angular LSH (2^bits buckets)")
    seed: int = Field(0, ge=0, description="seed of the hyperplanes and the samples (the same seed, the same output)")
    exact_kernel: bool = Field(
        True,
        description="the exact causal pieces through PyTorch's fused CPU attention (which also "
        "returns the log-sum-exp); false: explicit softmax in PyTorch (the oracle)",
    )


@hookimpl
def graft_register_attention(register):
    register(
        Registration(
            name="hyperattention",
            summary="Approximate long-prompt prefill attention: sortLSH blocks attended exactly plus "
            "uniformly sampled keys for the rest, causal by recursive halving; decode and short "
            "prompts exact (lossy)",
            paper="HyperAttention: Long-context Attention in Near-Linear Time (arXiv:2310.05343)",
            params=HyperAttentionParams,
            impl="vllm_graft.plugins.attention.hyperattention.reference:HyperAttention",
            # dp only: its hyperplanes and samples are drawn per KV head of the rank, so two ranks'
            # approximation is not one rank's, and no two-rank case has run it
            capabilities=Capabilities(
                parallelism=("dp",), lossless=False, unsupported_features=ATTENTION_BACKEND_LIMITS
            ),
        )
    )
