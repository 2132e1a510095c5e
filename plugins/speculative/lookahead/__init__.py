"""`lookahead` proposer: a trie of token windows from prompts and outputs, shared across
requests, capped in memory with frequency pruning."""

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ....hooks import Capabilities, Registration, hookimpl


class LookaheadParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_speculative_tokens: int = Field(
        4, ge=1, le=128, description="most draft tokens per step (with tree: true, the most tree nodes)"
    )
    depth: int = Field(
        8,
        ge=2,
        le=64,
        description="tokens per inserted window (matched "
        "suffix + drafts <= depth; suffixes of up to depth - drafts tokens are matched)",
    )
    min_match: int = Field(1, ge=1, description="shortest suffix that may be matched")
    max_nodes: int = Field(200_000, ge=2, description="memory cap: most trie nodes kept")
    prune_to: float = Field(
        0.75, gt=0.0, lt=1.0, description="after pruning the trie holds at most this share of max_nodes"
    )
    shared_prompts: bool = Field(
        False,
        description="insert every window of every prompt into the shared trie (matches into other "
        "requests' prompts; ~6 us of Python per prompt token at depth 8). false: each request's "
        "prompt is matched in an index of its own (~0.3 us a token) and the trie holds the "
        "windows from each request's first draft on",
    )
    spec_factor: float = Field(
        0.0,
        ge=0.0,
        description="with > 0, a draft is at most ceil(spec_factor x the matched suffix's length) "
        "tokens (SuffixDecoding's max_spec_factor): a long match (copying) drafts long, a one-token "
        "match little. 0: num_speculative_tokens whatever the match",
    )
    min_prob: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="draft only while the continuation's estimated probability (from the trie's "
        "counts) is at least this; with tree: true, the tree takes the likeliest nodes above it "
        "(SuffixDecoding's greedy tree) instead of tree_branches chains. 0: every matched token",
    )
    calibrate: bool = Field(
        False,
        description="draft length from measured acceptance: each kind of match (the request's own "
        "text or other requests' outputs, by matched length) keeps the rate at which its drafts were "
        "accepted, and a draft runs while the chance that all its tokens are accepted is at least "
        "B / (fixed_cost_tokens + B) at batch size B (long for copying, none for a guess at a large "
        "batch). Other requests' outputs are then matched in an index of token triples and "
        "continued by the vote of their occurrences, not through the trie. Chains only (not with "
        "tree: true or shared_prompts: true)",
    )
    fixed_cost_tokens: float = Field(
        64.0,
        gt=0.0,
        description="calibrate: the tokens a drafting step can verify for the cost of one more "
        "step's fixed part (larger: draft more at large batches)",
    )
    tree: bool = Field(
        False,
        description="draft a tree of up to tree_branches continuations "
        "(sharing their prefixes) instead of one, verified in one forward with a tree "
        "attention mask; num_speculative_tokens is then the most tree nodes per step",
    )
    tree_branches: int = Field(4, ge=1, le=64, description="tree mode: continuations merged into the tree")
    tree_depth: int = Field(4, ge=1, le=32, description="tree mode: most tokens per continuation")

    @model_validator(mode="after")
    def _consistent(self):
        if self.min_match >= self.depth:
            raise ValueError(f"min_match ({self.min_match}) must be below depth ({self.depth})")
        if self.calibrate and self.tree:
            raise ValueError("calibrate sets chain lengths; it does not apply with tree: true (set one of them)")
        if self.calibrate and self.shared_prompts:
            raise ValueError(
                "calibrate matches each prompt in its own index and drafts without the trie; "
                "shared_prompts: true (prompts in the trie) does not apply with it (set one of them)"
            )
        if self.max_nodes < self.depth:
            raise ValueError(f"max_nodes ({self.max_nodes}) must be at least depth ({self.depth})")
        return self


@hookimpl
def graft_register_spec_proposers(register):
    register(
        Registration(
            name="lookahead",
            summary="Trie of token windows from prompts and outputs, shared across requests; "
            "drafts the most frequent continuation of the longest matching suffix",
            paper="Zhao et al., Lookahead: An Inference Acceleration Framework for LLM with Lossless "
            "Generation Accuracy (KDD 2024); Fu et al., Lookahead Decoding (ICML 2024)",
            params=LookaheadParams,
            impl="vllm_graft.plugins.speculative.lookahead.reference:TrieLookahead",
            capabilities=Capabilities(lossless=True, parallelism=("tp", "dp")),
        )
    )
