"""One adapter per plugin kind: turns the enabled plugins into vLLM registrations.

Adapters are the only code that imports vLLM (besides the bridge). Each is looked up
lazily, so that a deployment without, say, a quantization plugin never imports vLLM's
quantization layer. Contract of an adapter (see :class:`Adapter`):

* ``engine_overrides(enabled, plan)``: engine arguments the plugins need (e.g.
  ``speculative_config`` for a proposer); applied by the bridge in the front end
  (``engine_why`` says why, for the log and for the refusal of a conflicting value).
* ``activate(enabled, plan, runtime)``: register into vLLM in this process (called in
  every vLLM process); must be idempotent per deployment.
* ``deactivate()``: undo it (the bridge also undoes the adapter's patches).

What a plugin does at run time is recorded with ``runtime.count(kind, name, event)`` and
the plugin's own ``describe()``; `vllm-graft demo` and `bench` print both.
"""
from __future__ import annotations

import importlib
from typing import Any

from vllm_graft.hooks import KINDS, Kind, Plan
from vllm_graft.hooks.deployment import Enabled

from vllm_graft.integration.runtime import Runtime

class Adapter:
    kind: Kind
    owner: str = "adapter"
    #: Why the adapter needs an engine argument it sets in :meth:`engine_overrides` (by
    #: argument name): the bridge logs it once when it sets the argument for the user, and
    #: names it when the user's own value conflicts.
    engine_why: dict[str, str] = {}

    def engine_overrides(self, enabled: list[Enabled], plan: Plan) -> dict[str, Any]:
        return {}

    def activate(self, enabled: list[Enabled], plan: Plan, runtime: Runtime) -> None:
        raise NotImplementedError

    def deactivate(self) -> None:
        pass


def attention_backend_overrides(plan: Plan) -> dict[str, Any]:
    """Engine arguments of the adapters that install vllm-graft's attention backend (attention,
    kvcompress): on CUDA vLLM selects the CUSTOM backend (:mod:`.custom_backend`) only when
    asked; on CPU the CPU_ATTN override needs nothing."""
    return {"attention_backend": "CUSTOM"} if plan.platform == "cuda" else {}


_cache: dict[Kind, Adapter] = {}


def adapter_for(kind: Kind) -> Adapter:
    """The adapter of ``kind``: ``ADAPTER`` of its module (:attr:`KindSpec.adapter`,
    ``vllm_graft.integration.adapters.<kind>.engine``), imported on first use."""
    kind = Kind(kind)
    if kind not in _cache:
        _cache[kind] = importlib.import_module(KINDS[kind].adapter).ADAPTER
    return _cache[kind]
