"""Parameters of the compressors that keep the top blocks by one score per block (``tova``,
``knorm``, ``keydiff``): the keep policy's (``hooks.contracts.kvpolicy.PolicyParams``) with
``sink_blocks``; and the checks the eviction compressors' parameter models share (each model's
validator calls the ones its fields need, saying what its own rule protects)."""

from typing import Any, TypeVar

from pydantic import Field, model_validator

from ....hooks import Capabilities, PolicyParams

P = TypeVar("P")


def sinks_leave_room(params: P, needs: str) -> P:
    """``params``, or a ValueError when its ``sink_blocks`` take the whole ``budget_blocks``
    (``needs``: what needs a block of the budget besides them)."""
    p: Any = params
    if p.sink_blocks >= p.budget_blocks:
        raise ValueError(
            f"sink_blocks ({p.sink_blocks}) must be smaller than budget_blocks ({p.budget_blocks}): {needs}"
        )
    return params


def fixed_blocks_fit(params: P, rest: str = "") -> P:
    """``params``, or a ValueError when its ``sink_blocks`` and ``recent_blocks`` (always kept)
    exceed ``budget_blocks`` (``rest``: what the message adds, e.g. what the rest holds)."""
    p: Any = params
    if p.sink_blocks + p.recent_blocks > p.budget_blocks:
        raise ValueError(
            f"sink_blocks + recent_blocks ({p.sink_blocks} + {p.recent_blocks}) must not "
            f"exceed budget_blocks ({p.budget_blocks}){rest}"
        )
    return params


def held_blocks_field(unit: str, most: str = "") -> Any:
    """The ``held_blocks`` parameter of a compressor whose units (``unit``: "head", "layer")
    each keep their own blocks: the cap on their union, which a request holds (``most``: what
    the union is at most without it)."""
    return Field(
        None,
        ge=2,
        description=f"at most this many prompt blocks held per request (the union over {unit}s: vLLM frees a "
        f"block only when no {unit} keeps it); None: the union as chosen{most}",
    )


def held_blocks_fit(params: P, keepers: str) -> P:
    """``params``, or a ValueError when its ``held_blocks`` (the cap on the union of the blocks
    that the units, KV heads or layers, keep) is below ``budget_blocks`` (a unit's average:
    ``keepers`` say whose, e.g. "a head keeps")."""
    p: Any = params
    if p.held_blocks is not None and p.held_blocks < p.budget_blocks:
        raise ValueError(
            f"held_blocks ({p.held_blocks}) must be at least budget_blocks ({p.budget_blocks}): {keepers} "
            "budget_blocks prompt blocks on average, all of them held; raise held_blocks or lower budget_blocks"
        )
    return params


class TopBlocksParams(PolicyParams):
    sink_blocks: int = Field(0, ge=0, description="leading blocks always kept (the papers keep none)")

    @model_validator(mode="after")
    def _room(self):
        return sinks_leave_room(self, "the block being written is always kept")


def storage_capabilities(parallelism: tuple[str, ...]) -> Capabilities:
    """What a KV storage format (``kv4``, ``million``: a uint8 cache of its own codes, written and
    attended by its own code) supports: float caches, the common head sizes, plain causal decoder
    attention only."""
    return Capabilities(
        parallelism=parallelism,
        lossless=False,
        role="storage",
        dtypes=("float32", "float16", "bfloat16"),
        head_sizes=(32, 64, 96, 128, 256),
        unsupported_features=("sliding_window", "mla", "encoder_attention", "alibi", "soft_cap", "attention_sinks"),
    )
