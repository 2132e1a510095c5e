"""What every check and exercise of the conformance kit shares: the plugin under test
(:class:`Target`), the two outcomes besides success (:class:`ConformanceError`,
:class:`Skipped`), building the plugin as the vLLM adapters do (:func:`build`), and the
numeric helpers (tolerances per dtype, max abs error).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from ...hooks import Kind, contract_for
from ...hooks.registry import Entry


class ConformanceError(AssertionError):
    """A plugin breaks its kind's contract; the message names the plugin and the fix."""


class Skipped(Exception):
    """The check does not apply to this plugin (the message says why)."""


@dataclass(frozen=True)
class Target:
    """One plugin under test, with the parameters (a dict, as in a deployment) to use."""

    entry: Entry
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def kind(self) -> Kind:
        return self.entry.kind

    @property
    def spec(self) -> str:
        return f"{self.entry.kind.value}:{self.entry.name}"

    def fail(self, what: str) -> ConformanceError:
        src = self.entry.source
        return ConformanceError(f"{self.spec} (from {src.package} {src.version}): {what}")


def build(target: Target, **changes: Any) -> Any:
    """The plugin's implementation, built as the vLLM adapters build it."""
    reg = target.entry.registration
    values = {**target.params, **changes}
    try:
        params = reg.params(**values)
    except ValidationError as e:
        raise target.fail(f"its parameters {values} do not validate: {e}") from None
    cls = reg.load()
    contract = contract_for(target.kind, reg.capabilities.role)
    if not (isinstance(cls, type) and issubclass(cls, contract)):
        raise target.fail(f"impl {reg.impl!r} is {cls!r}, not a subclass of vllm_graft.hooks.{contract.__name__}")
    return cls(params)


# ------------------------------------------------------------------------- numeric helpers
def example_params(entry: Entry, override: dict[str, Any] | None = None) -> dict[str, Any]:
    """Parameters to build the plugin with: ``override``, else the model's defaults, else the
    first of its ``json_schema_extra["examples"]``."""
    model = entry.registration.params
    if override is not None:
        return dict(override)
    try:
        model()
        return {}
    except ValidationError:
        pass
    extra = model.model_config.get("json_schema_extra") or {}
    examples = extra.get("examples") if isinstance(extra, dict) else None
    if isinstance(examples, list) and examples and isinstance(examples[0], dict):
        return dict(examples[0])
    raise ConformanceError(
        f"{entry.kind.value}:{entry.name}: parameter model {model.__name__} has required fields "
        "and no example; add model_config = ConfigDict(extra='forbid', json_schema_extra="
        "{'examples': [{...}]}) or pass params= to the graft_conformance marker"
    )


def exercise_dtypes(t: Target) -> list[str]:
    """The dtypes to exercise: float32 and float16 where declared; bfloat16 only for a plugin
    that declares nothing else (the Triton interpreter's bf16 is unreliable)."""
    declared = t.entry.registration.capabilities.dtypes
    chosen = [d for d in ("float32", "float16") if d in declared]
    return chosen or [d for d in declared if d == "bfloat16"] or ["float32"]


def torch_module():
    import torch

    return torch


def torch_dtype(name: str):
    return getattr(torch_module(), name)


def tolerance(dtype: str) -> float:
    return {"float32": 2e-4, "float16": 2e-2, "bfloat16": 1e-1}[dtype]


def max_err(a: Any, b: Any) -> float:
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
