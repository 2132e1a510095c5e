"""`kvzip` KV compressor (KVzip, Kim et al. 2025, "KVzip: Query-Agnostic KV Cache Compression
with Context Reconstruction", arXiv:2505.23416) at block granularity.

The paper scores each cached KV pair of a context by how much the model needs it to *repeat*
the context: after prefilling the context ``c``, the model is teacher-forced on "Repeat the
previous context:" followed by ``c`` itself, attending over ``c``'s KV cache; a pair (layer, KV
head, position) scores the largest attention probability that any query of the repeated part,
over the query heads of its GQA group, puts on it. The lowest-scoring pairs are evicted (ranked
globally over heads and layers), whatever question comes later: the compression is
query-agnostic. Long contexts are reconstructed in chunks: each chunk of ``c`` is repeated on
its own (after the prompt and, past the first chunk, the previous chunk's last
``resume_tokens`` tokens), its queries attending over the whole cache of ``c`` and the chunk's
repeat so far; the reconstruction's own KV is discarded.

How it runs in vLLM (the design, and why). The reconstruction is an extra forward pass whose
queries are not the prompt's, and its KV must never reach the paged cache. Once a request's
prompt is prefilled, the worker (after the step's sampling, in the scores channel of the
kvcompress adapter: ``integration/adapters/kvcompress/scoring_forward.py``) runs the model's own
forward on each chunk's tokens (:meth:`~.reference.KVzip.scoring_passes`), positions continuing
after the context, under a forward context whose every layer carries a *scoring-pass* metadata:
the graft attention backend then attends over the request's context KV read from the paged cache
plus the chunk's own K/V held in a local tensor (no slot mapping: nothing is written, no block is
allocated), and folds the per-pair max attention into a buffer. The pair scores are reduced to
one score per block (:meth:`~.reference.KVzip.pass_block_scores`) and the keep policy drops
blocks as SnapKV's does; the drops travel to the scheduler, which frees them. The alternative,
a separate prefix-cached "scoring request" through the scheduler, would allocate blocks for the
repeat, schedule it among real requests and need a way to hand its attention back to the
original request; the in-worker pass needs none of that and costs one forward per chunk.

What vLLM's structure changes from the paper:

* Granularity: vLLM frees KV per block, for every layer and KV head at once, so one keep set
  serves all layers and heads (the paper evicts pairs, each head and layer its own). A block's
  score is the sum over layers and KV heads of the largest (``block_reduce: max``) or mean
  (``mean``) pair score among its tokens: a block counts as much as the (layer, head) pairs that
  need some token of it, and how strongly. The paper's global ranking across heads and layers
  becomes a ranking of blocks by that sum.
* The budget is the policy's (``budget_blocks``, or ``keep_ratio`` of the prompt's blocks;
  kvpress's ``compression_ratio`` 0.75 is ``keep_ratio: 0.25``); ``sink_blocks`` (default 1)
  stands for the paper's always-kept first tokens; generated blocks are all kept (the prompt is
  the context).
* The whole prompt is the context (the worker cannot tell a chat template's system part from
  the user's text); chunks are of ``chunk_tokens`` tokens.
* Tensor parallelism (``tp``): every rank runs the passes (the model's collectives in step),
  scores its own KV heads, and the block scores are summed over the ranks (a sum over heads), so
  the ranks drop the blocks one rank drops (tests/e2e/test_tensor_parallel.py's kvzip rank case,
  ``GRAFT_TP_MATRIX=kvcompress``).
"""

from typing import Literal

from pydantic import Field, model_validator

from ....hooks import Capabilities, PolicyParams, Registration, hookimpl

from .._shared.params import fixed_blocks_fit, sinks_leave_room


class KVzipParams(PolicyParams):
    budget_blocks: int = Field(16, ge=2, description="prompt KV blocks a request keeps after prefill")
    sink_blocks: int = Field(1, ge=0, description="leading blocks always kept (the paper keeps the first tokens)")
    recent_blocks: int = Field(0, ge=0, description="last prompt blocks always kept (0: only the one being written)")
    chunk_tokens: int = Field(
        512,
        ge=16,
        description="context tokens repeated per reconstruction pass (one forward each; the paper's chunking)",
    )
    repeat_prompt: str = Field(
        "\n\nRepeat the previous context:",
        min_length=1,
        description="text fed before each chunk of the repeated context (its queries do not score)",
    )
    resume_tokens: int = Field(
        8,
        ge=0,
        description="past the first chunk, the previous chunk's last tokens fed after the prompt (where to resume)",
    )
    block_reduce: Literal["max", "mean"] = Field(
        "max",
        description="a block's score per layer and KV head: the max (or mean) of its tokens' pair scores; "
        "summed over layers and KV heads",
    )

    @model_validator(mode="after")
    def _room(self):
        return fixed_blocks_fit(sinks_leave_room(self, "the block being written is always kept"))


@hookimpl
def graft_register_kv_compressors(register):
    register(
        Registration(
            name="kvzip",
            summary="KVzip: after prefill, keeps the prompt blocks the model attends to most while repeating "
            "the context (query-agnostic)",
            paper="Kim et al. 2025, KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction "
            "(arXiv:2505.23416)",
            params=KVzipParams,
            impl="vllm_graft.plugins.kvcompress.kvzip.reference:KVzip",
            capabilities=Capabilities(lossless=False, parallelism=("tp", "dp")),
        )
    )
