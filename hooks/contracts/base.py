"""The base of every kind's contract: the validated parameters and ``describe()``."""
from __future__ import annotations

from abc import ABC
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

from ..kinds import Kind

P = TypeVar("P", bound=BaseModel)


class PluginImpl(ABC, Generic[P]):
    """Base of every contract: holds the validated parameters."""

    kind: Kind

    def __init__(self, params: P) -> None:
        self.params = params

    def describe(self) -> dict[str, Any]:
        """What the plugin did so far, for `vllm-graft demo` and benchmark reports."""
        return {}
