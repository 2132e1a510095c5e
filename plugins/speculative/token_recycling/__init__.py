"""`token-recycling` proposer: the target's discarded top-k candidates, kept in a
vocab x k successor matrix, drafted along the most probable path."""
from pydantic import BaseModel, ConfigDict, Field

from vllm_graft.hooks import Capabilities, Registration, hookimpl


class TokenRecyclingParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_speculative_tokens: int = Field(
        4, ge=1, le=32, description="most draft tokens per step (the path length walked)")
    k: int = Field(8, ge=1, le=64, description="successors kept per token (matrix columns; "
                   "the top-k taken from each verify step's logits)")
    vocab_size: int | None = Field(
        None, ge=1, description="matrix rows; default: grown to the largest token id seen")


@hookimpl
def graft_register_spec_proposers(register):
    register(Registration(
        name="token-recycling",
        summary="Successor matrix from the verify step's top-k; drafts its most probable path",
        paper="Luo et al., Turning Trash into Treasure: Accelerating Inference of LLMs with "
              "Token Recycling (arXiv:2408.08696)",
        params=TokenRecyclingParams,
        impl="vllm_graft.plugins.speculative.token_recycling.reference:TokenRecycling",
        capabilities=Capabilities(parallelism=("tp", "dp"), lossless=True),
    ))
