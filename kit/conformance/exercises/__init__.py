"""The kit's per-kind exercises: for each kind, a function ``(target, impl, dtype, rules)`` that
drives the plugin on generated inputs and returns ``[(label, result), ...]``; with ``rules``
it raises :class:`~vllm_graft.kit.conformance.base.ConformanceError` where the plugin breaks
its kind's contract. The ``contract`` check runs it with rules, ``parity`` compares the
results of the reference and Triton paths. One module per kind; :data:`EXERCISES` has one
entry per kind of :data:`vllm_graft.hooks.KINDS`.
"""

from __future__ import annotations

from typing import Any, Callable

from ....hooks import KINDS, Kind
from ..base import Target
from .attention import exercise_attention
from .kvcompress import exercise_kvcompress
from .moe import exercise_moe
from .quant import exercise_quant
from .speculative import exercise_speculative

Exercise = Callable[[Target, Any, str, bool], list[tuple[str, Any]]]

EXERCISES: dict[Kind, Exercise] = {
    Kind.ATTENTION: exercise_attention,
    Kind.KVCOMPRESS: exercise_kvcompress,
    Kind.SPECULATIVE: exercise_speculative,
    Kind.QUANT: exercise_quant,
    Kind.MOE: exercise_moe,
}

__all__ = ["EXERCISES", "Exercise"]
assert set(EXERCISES) == set(KINDS), f"no exercise for {sorted(set(KINDS) - set(EXERCISES))}"
