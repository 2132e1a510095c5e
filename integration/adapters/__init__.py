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
import logging
from typing import Any, Generic, TypeVar

from ...hooks import Kind, Plan
from ...hooks.deployment import Enabled

from ..runtime import RUNTIME, Runtime

log = logging.getLogger("vllm_graft")


S = TypeVar("S")


class Adapter(Generic[S]):
    kind: Kind
    owner: str = "adapter"
    #: Why the adapter needs an engine argument it sets in :meth:`engine_overrides` (by
    #: argument name): the bridge logs it once when it sets the argument for the user, and
    #: names it when the user's own value conflicts.
    engine_why: dict[str, str] = {}
    #: The dataclass of the adapter's per-deployment state, or None. The adapter object itself
    #: holds none (it is module-level): its state is :attr:`state`, an instance on the process's
    #: runtime (``RUNTIME.kind_state(kind, State)``), which ``RUNTIME.reset`` forgets.
    State: type[S] | None = None

    @property
    def state(self) -> S:
        """This process's per-deployment state of the adapter (made on first use)."""
        if self.State is None:
            raise TypeError(f"the {self.kind} adapter keeps no state")
        return RUNTIME.kind_state(self.kind, self.State)

    def engine_overrides(self, enabled: list[Enabled], plan: Plan) -> dict[str, Any]:
        return {}

    def activate(self, enabled: list[Enabled], plan: Plan, runtime: Runtime) -> None:
        raise NotImplementedError

    def deactivate(self) -> None:
        pass


def attention_backend_overrides(plan: Plan) -> dict[str, Any]:
    """Engine arguments of the adapters that install vllm-graft's attention seams (attention,
    kvcompress). On CPU and on CUDA nothing: vLLM picks its backend as it would, and the one it
    picks carries the seams (CPU_ATTN; FLASH_ATTN, FLASHINFER, TRITON_ATTN). Only where the
    deployment's engine section names a CUDA backend the bridge does not know (e.g.
    FLEX_ATTENTION) does vLLM get ``attention_backend=CUSTOM``: vllm-graft's generic backend,
    PyTorch attention on every layer (said once in the log)."""
    if plan.platform != "cuda":
        return {}
    asked = (plan.deployment.engine or {}).get("attention_backend")
    if asked is None or str(asked).upper() in _CUDA_BACKENDS_WITH_SEAMS or str(asked).upper() == "CUSTOM":
        return {}
    if RUNTIME.once(("generic backend", asked)):
        log.warning(
            "vllm-graft: attention_backend=%s has no vllm-graft seams; the deployment runs "
            "on vllm-graft's generic CUSTOM backend instead (PyTorch attention on every layer, "
            "no full CUDA graphs: much slower than vLLM's kernels). Leave attention_backend "
            "out, or name FLASH_ATTN, FLASHINFER or TRITON_ATTN, to keep vLLM's kernels.",
            asked,
        )
    return {"attention_backend": "CUSTOM"}


#: vLLM's CUDA backends that vllm-graft subclasses (:data:`.backend.CUDA_PATHS`; named here so
#: that the front end need not import vLLM)
_CUDA_BACKENDS_WITH_SEAMS = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN")


#: Import cache (the one module-level table here): each kind's ``ADAPTER``, the same object as
#: its module's, found once per process; it adds no state of its own (deactivation, which is
#: :meth:`~vllm_graft.integration.runtime.Runtime.reset`, calls each activated adapter's
#: ``deactivate``). Allowed by tests/unit/test_runtime_state.py.
_cache: dict[Kind, Adapter] = {}


def adapter_module(kind: Kind) -> str:
    """Module of ``kind``'s vLLM adapter (exposing ``ADAPTER``): ``<this package>.<kind>.engine``."""
    return f"{__name__}.{Kind(kind).value}.engine"


def adapter_for(kind: Kind) -> Adapter:
    """The adapter of ``kind``: ``ADAPTER`` of :func:`adapter_module`, imported on first use."""
    kind = Kind(kind)
    if kind not in _cache:
        _cache[kind] = importlib.import_module(adapter_module(kind)).ADAPTER
    return _cache[kind]
