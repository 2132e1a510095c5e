"""`streaming` KV compressor (StreamingLLM, Xiao et al. 2023, arXiv:2309.17453): keep the
first ``sink_blocks`` blocks (the "attention sinks") and the most recent blocks, at most
``budget_blocks`` blocks per request in all; every block in between is freed.

Block-granular: a block holds ``block_size`` tokens (the engine's ``block_size``), so the
budget in tokens is ``budget_blocks * block_size``. The recent window includes the block
being written (partly filled), so a request holds ``budget_blocks`` blocks after each step's
eviction (plus the block a new token may open, and any prefix-cache blocks shared with other
requests, which are never freed from under them).
"""

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ....hooks import Capabilities, Registration, hookimpl

from .._shared.params import sinks_leave_room


class StreamingParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    budget_blocks: int = Field(16, ge=2, description="KV blocks a request keeps: sinks + recent window")
    sink_blocks: int = Field(1, ge=0, description="leading blocks always kept (attention sinks)")

    @model_validator(mode="after")
    def _window_left(self):
        return sinks_leave_room(
            self, "the recent window (which holds the block being written) needs at least one block"
        )


@hookimpl
def graft_register_kv_compressors(register):
    register(
        Registration(
            name="streaming",
            summary="StreamingLLM: keeps sink blocks + a recent window of blocks, frees the rest",
            paper="Xiao et al. 2023, Efficient Streaming Language Models with Attention Sinks (arXiv:2309.17453)",
            params=StreamingParams,
            impl="vllm_graft.plugins.kvcompress.streaming.reference:Streaming",
            capabilities=Capabilities(lossless=False, parallelism=("tp", "pp", "dp")),
        )
    )
