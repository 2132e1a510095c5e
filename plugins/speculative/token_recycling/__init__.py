"""`token-recycling` proposer: the target's discarded top-k candidates, kept in a
vocab x k successor matrix, drafted along the most probable path."""

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ....hooks import Capabilities, Registration, hookimpl


class TokenRecyclingParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_speculative_tokens: int = Field(
        4,
        ge=1,
        le=128,
        description="most draft tokens per step: the path length walked, or "
        "with tree: true the most tree nodes (vLLM reserves that many verification slots)",
    )
    k: int = Field(
        8,
        ge=1,
        le=64,
        description="successors kept per token (matrix columns; the top-k taken from each verify step's logits)",
    )
    vocab_size: int | None = Field(None, ge=1, description="matrix rows; default: grown to the largest token id seen")
    tree: bool = Field(
        False,
        description="draft the paper's static tree (tree_breadth) instead "
        "of one path, verified in one forward with a tree attention mask; "
        "num_speculative_tokens is then the most tree nodes per step (breadth-first)",
    )
    tree_breadth: list[int] = Field(
        [4, 2, 1, 1],
        min_length=1,
        max_length=16,
        description="tree mode: children per node "
        "at each depth (the tree has sum of their running products nodes: 28 for [4, 2, 1, 1])",
    )

    @field_validator("tree_breadth")
    @classmethod
    def _breadth(cls, value: list[int]) -> list[int]:
        if any(b < 1 for b in value):
            raise ValueError(f"tree_breadth entries must be >= 1, got {value}")
        return value


@hookimpl
def graft_register_spec_proposers(register):
    register(
        Registration(
            name="token-recycling",
            summary="Successor matrix from the verify step's top-k; drafts its most probable path",
            paper="Luo et al., Turning Trash into Treasure: Accelerating Inference of LLMs with "
            "Token Recycling (arXiv:2408.08696)",
            params=TokenRecyclingParams,
            impl="vllm_graft.plugins.speculative.token_recycling.reference:TokenRecycling",
            capabilities=Capabilities(parallelism=("tp", "dp"), lossless=True),
        )
    )
