"""`rkv` KV compressor (R-KV, Cai et al. 2025, "R-KV: Redundancy-aware KV Cache Compression for
Reasoning Models", arXiv:2505.24133) at block granularity: decode-time compression for long
outputs.

R-KV compresses while the model decodes, not once after the prompt: new tokens go to a buffer,
and when it is full the cache is cut back to the budget, keeping the tokens that are both
important (the attention the latest queries pay them) and not redundant (a key much like many
others adds little: reasoning traces repeat themselves). Its score is
``importance_weight x importance - (1 - importance_weight) x redundancy``.

Here: a request may hold ``budget_blocks`` + ``slack_blocks`` blocks (the buffer, default 4
blocks) before it is cut back to ``budget_blocks`` (the keep policy's slack,
``hooks.contracts.kvpolicy``); over the whole sequence, prompt and generation alike. A block's
importance is the current query's attention mass on it (per layer, as a fraction of the heads'
total), its redundancy the mean cosine similarity of its keys to the sequence's mean key (the
mean similarity to all other keys, as KeyDiff measures it); both summed over layers, at the step
that cuts. Where it departs from the paper: the importance is the current query's alone (the
paper's last ``alpha`` queries; a window of them would need state per request across steps), and
the redundancy is to the mean key (the paper's pairwise similarities, thresholded).

The mass comes from the worker's shared attention with mass, which hands it with the cache to
``block_scores``.
"""

from pydantic import Field

from ....hooks import Capabilities, Registration, hookimpl

from .._shared.params import TopBlocksParams


class RKVParams(TopBlocksParams):
    slack_blocks: int = Field(
        4,
        ge=1,
        description="blocks a request may hold beyond the budget before it is cut back (R-KV's buffer)",
    )
    sink_blocks: int = Field(1, ge=0, description="leading blocks always kept")
    importance_weight: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="weight of importance (current query's attention) against redundancy (similarity "
        "to the mean key): score = w x importance - (1 - w) x redundancy",
    )


@hookimpl
def graft_register_kv_compressors(register):
    register(
        Registration(
            name="rkv",
            summary="R-KV: decode-time compression with a buffer, keeping important and non-redundant blocks",
            paper="Cai et al. 2025, R-KV: Redundancy-aware KV Cache Compression for Reasoning Models (arXiv:2505.24133)",
            params=RKVParams,
            impl="vllm_graft.plugins.kvcompress.rkv.reference:RKV",
            # tp: its scores are summed over the ranks' KV heads (tests/e2e/test_tensor_parallel.py)
            capabilities=Capabilities(lossless=False, parallelism=("tp", "dp")),
        )
    )
