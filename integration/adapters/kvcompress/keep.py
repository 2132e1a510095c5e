"""The rules of :meth:`~vllm_graft.hooks.KVCompressor.keep`, checked on every answer by the
KV-compression adapter and by the conformance kit, and :class:`KeepAll`. vLLM-free.

The rules live next to the contract, in ``vllm_graft.hooks.contracts.kvcompress`` (exported by
``vllm_graft.hooks``: :func:`check_keep`, :func:`check_keep_heads`, :func:`dropped_blocks`,
:func:`union_of_heads`, :class:`KeepError`); they are re-exported here for the adapter's modules.
"""

from __future__ import annotations

from ....hooks import (
    BlockView,
    KeepError,
    KVCompressor,
    NoParams,
    check_keep,
    check_keep_heads,
    check_keep_layers,
    dropped_blocks,
    union_of_heads,
)

from ..plugin_calls import raised

__all__ = [
    "KeepAll",
    "KeepError",
    "ask",
    "check_keep",
    "check_keep_heads",
    "check_keep_layers",
    "dropped_blocks",
    "union_of_heads",
]


def ask(compressor: KVCompressor, view: BlockView, plugin: str, method: str = "keep"):
    """``compressor.keep(view)`` (or ``keep_heads``), unchecked; an exception it raises is
    re-raised naming the plugin (:func:`~vllm_graft.integration.adapters.plugin_calls.raised`)."""
    try:
        return getattr(compressor, method)(view)
    except Exception as e:
        raise raised("kvcompress", plugin, f"{method}()", e) from e


class KeepAll(KVCompressor):
    """The eviction half of a deployment whose ``kvcompress:`` has only a storage format
    (e.g. ``kv4`` alone): every block stays."""

    def __init__(self) -> None:
        super().__init__(NoParams())

    def keep(self, view: BlockView) -> list[int]:
        return list(range(view.num_blocks))
