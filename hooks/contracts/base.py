"""The base of every kind's contract: the validated parameters and ``describe()``."""

from __future__ import annotations

from abc import ABC
from typing import Any, Generic, NamedTuple, TypeVar

from pydantic import BaseModel

from ..kinds import Kind

P = TypeVar("P", bound=BaseModel)


class PluginImpl(ABC, Generic[P]):
    """Base of every contract: holds the validated parameters.

    What a plugin is built with: its validated parameter model instance alone,
    ``cls(params)`` (``self.params``), once in each vLLM process that uses it (the engine core
    and every worker build their own instance: state is not shared between them). Everything
    else arrives through the contract's methods: the layer's facts and the step's batch
    (:class:`AttentionLayer`, :class:`PagedBatch`) with each attention call, a request's
    :class:`BlockView` with each ``keep``, the request id with each proposal, the model's MoE
    facts once through :meth:`MoEScheduler.bind`, the target's weights through
    :meth:`SelfSpeculativeProposer.attach_target`. Facts about the deployment (platform, dtype,
    model, KV block size) are for :meth:`Params.check_deployment`, at validation. A subclass
    that overrides ``__init__`` takes ``params`` and calls ``super().__init__(params)``.
    """

    kind: Kind

    def __init__(self, params: P) -> None:
        self.params = params

    def describe(self) -> dict[str, Any]:
        """What the plugin did so far, for `vllm-graft demo` and benchmark reports."""
        return {}


class ShapeProblem(NamedTuple):
    """What a kind's shape check (``hooks.contracts.SHAPE_CHECKS``) finds wrong with a plugin's
    class: ``message`` (what, and the fix), and ``other``, the ``kind:name`` of the plugin it
    cannot be combined with (None: the class alone is wrong)."""

    message: str
    other: str | None = None
