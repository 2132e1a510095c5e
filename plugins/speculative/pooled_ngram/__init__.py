"""`pooled-ngram` proposer (after STAND): n-grams of the target's own continuations, pooled
across the n samples of a prompt and across requests with the same prompt prefix."""

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ....hooks import Capabilities, Registration, hookimpl


class PooledNgramParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_speculative_tokens: int = Field(4, ge=1, le=32, description="most draft tokens per step")
    max_order: int = Field(4, ge=1, le=16, description="longest n-gram context")
    min_order: int = Field(1, ge=1, description="shortest n-gram context used to draft")
    prefix_tokens: int = Field(
        64, ge=1, description="requests whose prompts share this many leading tokens share a pool"
    )
    include_prompt: bool = Field(True, description="also pool the prompt's n-grams")
    max_contexts: int = Field(100_000, ge=1, description="memory cap: contexts per pool")
    max_pools: int = Field(64, ge=1, description="memory cap: pools kept (least recently used dropped)")

    @model_validator(mode="after")
    def _orders(self):
        if self.min_order > self.max_order:
            raise ValueError(f"min_order ({self.min_order}) must not exceed max_order ({self.max_order})")
        return self


@hookimpl
def graft_register_spec_proposers(register):
    register(
        Registration(
            name="pooled-ngram",
            summary="N-grams of the target's own outputs pooled across samples and requests "
            "sharing a prompt prefix (STAND)",
            paper="Song et al., Accelerated Test-Time Scaling with Model-Free Speculative Sampling "
            "(STAND, arXiv:2506.04708)",
            params=PooledNgramParams,
            impl="vllm_graft.plugins.speculative.pooled_ngram.reference:PooledNgram",
            capabilities=Capabilities(parallelism=("tp", "dp"), lossless=True),
        )
    )
