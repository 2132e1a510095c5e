"""`adaptive` proposer (after SmartSpec): wraps another proposer and picks each request's
draft length per step (0 = off) from its acceptance and the batch size."""

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ....hooks import Capabilities, Registration, hookimpl


class AdaptiveParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    proposer: str = Field("lookahead", description="the wrapped speculative plugin (`vllm-graft plugins`)")
    params: dict[str, Any] = Field(default_factory=dict, description="the wrapped plugin's parameters")
    num_speculative_tokens: int = Field(4, ge=1, le=32, description="longest draft per step")
    fixed_cost_tokens: float = Field(
        8.0,
        ge=0.0,
        description="cost model prior: the part of a step that does not grow "
        "with its tokens, in token-equivalents (larger: speculate more)",
    )
    prior_acceptance: float = Field(
        0.5, ge=0.0, lt=1.0, description="acceptance rate assumed before any draft was verified"
    )
    decay: float = Field(0.9, gt=0.0, le=1.0, description="weight kept by older observations per step")
    probe_every: int = Field(
        16, ge=1, description="with per-request lengths: steps a request sits at 0 (low acceptance) between probes"
    )
    measure_goodput: bool = Field(
        True,
        description="choose each step's shape (no drafts, a chain, and a tree where the wrapped "
        "proposer drafts trees) by measured goodput per batch-size bucket; false: the cost model "
        "alone sets each request's length",
    )
    per_request_length: bool = Field(
        False,
        description="with measured goodput: cut each request's draft to the cost model's length "
        "(fixed_cost_tokens, prior_acceptance, learn_cost); false: a drafting step drafts as the "
        "wrapped proposer does, up to num_speculative_tokens",
    )
    shadow_every: int = Field(
        4,
        ge=1,
        description="while no drafts is best, the yield of a chain is measured at most every this "
        "many steps (a shadow step: the wrapped proposer drafts for every request, nothing is "
        "verified), less often where that costs over 5% of the undrafted steps' time",
    )
    chain_tokens: Optional[int] = Field(
        None,
        ge=1,
        le=32,
        description="longest chain when the wrapped proposer drafts trees (its num_speculative_tokens "
        "then counts tree nodes); default: its tree_depth",
    )
    learn_cost: bool = Field(
        True,
        description="learn the step cost model from measured step times (fixed_cost_tokens is then only the prior)",
    )

    @model_validator(mode="after")
    def _wrapped(self):
        from ....hooks import Kind
        from ....hooks.manager import get_registry

        registry = get_registry()
        names = [n for n in registry.names(Kind.SPECULATIVE) if n != "adaptive"]
        if self.proposer == "adaptive":
            raise ValueError("adaptive cannot wrap itself; name another proposer: " + ", ".join(names))
        if (Kind.SPECULATIVE, self.proposer) not in registry:
            raise ValueError(
                f"unknown wrapped proposer {self.proposer!r}; installed speculative "
                f"plugins: {', '.join(names) or 'none'}"
            )
        try:
            self.inner_params()
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or '(params)'}: {err['msg']}" for err in e.errors())
            raise ValueError(f"params of wrapped proposer {self.proposer!r}: {problems}") from None
        return self

    @property
    def tree(self) -> bool:
        """Whether the wrapped proposer drafts trees (its ``tree`` parameter): deployment
        validation reads this (``hooks.contracts.speculative.TREE_FIELD``) to refuse what tree
        verification cannot run with, as for the proposer itself."""
        from ....hooks.contracts.speculative import TREE_FIELD

        return getattr(self.inner_params(), TREE_FIELD, None) is True

    def inner_params(self) -> BaseModel:
        """The wrapped plugin's validated parameters (its ``num_speculative_tokens``, when it
        has one and it is not given, is this plugin's)."""
        from ....hooks import Kind
        from ....hooks.manager import get_registry

        model = get_registry().get(Kind.SPECULATIVE, self.proposer).registration.params
        raw = dict(self.params)
        if "num_speculative_tokens" in model.model_fields:
            raw.setdefault("num_speculative_tokens", self.num_speculative_tokens)
        return model.model_validate(raw)


@hookimpl
def graft_register_spec_proposers(register):
    register(
        Registration(
            name="adaptive",
            summary="Wraps a proposer; per-request draft length each step (0 = off) from "
            "acceptance and batch size, and each step's shape (none, chain, tree) by measured "
            "goodput (SmartSpec)",
            paper="Liu et al., Optimizing Speculative Decoding for Serving LLMs Using Goodput "
            "(SmartSpec, arXiv:2406.14066)",
            params=AdaptiveParams,
            impl="vllm_graft.plugins.speculative.adaptive.reference:Adaptive",
            capabilities=Capabilities(parallelism=("tp", "dp"), lossless=True),
        )
    )
