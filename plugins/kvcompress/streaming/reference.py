"""StreamingLLM at block granularity: sinks + recent window (see ``__init__``), as a policy whose
score is recency (``hooks.contracts.kvpolicy``): the sink blocks, the block being written and the
newest others, ``budget_blocks`` in all."""

from vllm_graft.hooks import Recency


class Streaming(Recency):
    pass
