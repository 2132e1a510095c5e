"""Per-process state of the active deployment: the plugin instances and what they did.

Every vLLM process (front end, engine core, workers) activates the deployment on its own
(see :mod:`vllm_graft.integration.bridge`) and so has its own :data:`RUNTIME`. With the
in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, what `vllm-graft demo` and
`bench` use) they are all one process, so :meth:`Runtime.report` sees every plugin.
"""
from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from vllm_graft.hooks import Kind, Plan, PluginImpl, contract_for
from vllm_graft.hooks.deployment import Enabled


class PluginContractError(TypeError):
    """A plugin's implementation does not implement the contract of its kind."""


@dataclass
class Runtime:
    plan: Plan | None = None
    source: str | None = None  # where the deployment came from (for messages)
    config_json: str | None = None  # the resolved deployment, as passed to child processes
    instances: dict[tuple[Kind, str], PluginImpl] = field(default_factory=dict)
    events: Counter = field(default_factory=Counter)  # (kind, name, event) -> count
    adapters: list[Any] = field(default_factory=list)  # activated, in order
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def active(self) -> bool:
        return self.plan is not None

    def enabled(self, kind: Kind) -> list[Enabled]:
        return self.plan.by_kind(kind) if self.plan else []

    def instance(self, enabled: Enabled) -> PluginImpl:
        """The process's one instance of an enabled plugin, built on first use."""
        key = (enabled.kind, enabled.name)
        with self._lock:
            impl = self.instances.get(key)
            if impl is None:
                cls = enabled.entry.registration.load()
                contract = contract_for(enabled.kind, enabled.entry.registration.capabilities.role)
                if not (isinstance(cls, type) and issubclass(cls, contract)):
                    raise PluginContractError(
                        f"{enabled.kind} plugin {enabled.name!r}: impl "
                        f"{enabled.entry.registration.impl!r} must be a subclass of "
                        f"vllm_graft.hooks.{contract.__name__} (from package {enabled.entry.source.package})")
                impl = cls(enabled.params)
                self.instances[key] = impl
            return impl

    def count(self, kind: Kind, name: str, event: str, n: int = 1) -> None:
        """Record that plugin ``name`` did ``event`` (n times): the proof it was reached."""
        self.events[(Kind(kind), name, event)] += n

    def counts(self, kind: Kind, name: str) -> dict[str, int]:
        return {ev: c for (k, nm, ev), c in self.events.items() if k == Kind(kind) and nm == name}

    def report(self) -> list[dict[str, Any]]:
        """Per enabled plugin: its parameters, the events counted in this process, and
        what its implementation says it did (``describe()``)."""
        out = []
        for e in self.plan.enabled if self.plan else []:
            impl = self.instances.get((e.kind, e.name))
            out.append({
                "kind": str(e.kind), "name": e.name, "params": e.params.model_dump(mode="json"),
                "events": self.counts(e.kind, e.name),
                "described": impl.describe() if impl is not None else {},
                "instantiated": impl is not None,
            })
        return out

    def reset(self) -> None:
        self.plan = self.source = self.config_json = None
        self.instances.clear()
        self.events.clear()
        self.adapters.clear()


#: This process's runtime.
RUNTIME = Runtime()
