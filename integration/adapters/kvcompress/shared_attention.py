"""The attention a scored compressor's mass comes from, when it leaves that to the worker.

A compressor with ``needs_scores`` may implement :meth:`~vllm_graft.hooks.KVCompressor.attend`
itself (its own attention and mass: ``kv4``'s format, a third-party kernel). One that does not
(``h2o``, ``snapkv``, ``adakv``, ``tova``: a scorer and a policy, nothing else) gets the shared
attention with per-block mass of ``plugins/kvcompress/_shared``: the exact PyTorch reference,
or with ``kernel: triton`` in its parameters the Triton decode kernel. Both read the cache in
every layout (:data:`SHARED_LAYOUTS`), taking each view's strides (``cpu_vec``'s keys have no unit
stride along the head dim). The worker (:mod:`.scores`) and the conformance kit call
:func:`attend_with_mass`, so a compressor is run and checked the same way. vLLM-free.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from ....hooks import KVCompressor

#: the cache layouts the shared attention reads (through ``layer.kv_layout.split``)
SHARED_LAYOUTS = ("blocked", "packed", "cpu_vec")


def uses_shared_attention(compressor: Any) -> bool:
    """A scored compressor that implements no ``attend`` of its own."""
    own = getattr(type(compressor), "attend", None)  # a duck-typed compressor may lack it
    return bool(getattr(compressor, "needs_scores", False)) and (own is None or own is KVCompressor.attend)


def scores_the_cache(compressor: Any) -> bool:
    """A scored compressor that scores blocks from the cache (``block_scores``), not by the mass."""
    own = getattr(type(compressor), "block_scores", None)  # a duck-typed compressor may lack it
    return bool(getattr(compressor, "needs_scores", False)) and own is not None and own is not KVCompressor.block_scores


def layouts_read(compressor: Any) -> tuple[str, ...]:
    """The cache layouts the compressor's attention reads: the shared attention's, or its own
    ``kv_layouts`` claim."""
    own = tuple(getattr(compressor, "kv_layouts", ("blocked",)))
    if uses_shared_attention(compressor):  # and its block_scores, where it has them, read its own claim
        return tuple(n for n in SHARED_LAYOUTS if n in own) if scores_the_cache(compressor) else SHARED_LAYOUTS
    return own


def attend_with_mass(compressor: Any, query, kv_cache, batch, layer, observe, head_mask=None):
    """``(out, mass)`` of the step's attention for ``compressor`` (see ``KVCompressor.attend``):
    its own ``attend``, or the shared one with its ``kernel`` parameter (default reference).
    ``head_mask`` is passed only to a per-head compressor (it is None for the others)."""
    if not uses_shared_attention(compressor):
        if head_mask is None:
            return compressor.attend(query, kv_cache, batch, layer, observe)
        return compressor.attend(query, kv_cache, batch, layer, observe, head_mask=head_mask)
    from ....plugins.kvcompress._shared import reference as shared

    kernel = getattr(getattr(compressor, "params", None), "kernel", "reference")
    return shared.attend(kernel, query, kv_cache, batch, layer, observe, head_mask=head_mask)


def block_scores(compressor: Any, kv_cache, batch, layer, query=None, observe=None, mass=None):
    """``compressor.block_scores`` with the step's ``query``, ``observe`` and ``mass`` where its
    signature takes them (a scorer written before they were part of the contract takes the
    cache alone)."""
    fn = compressor.block_scores
    takes = _takes(getattr(type(compressor), "block_scores"))
    extra = {k: v for k, v in (("query", query), ("observe", observe), ("mass", mass)) if k in takes}
    return fn(kv_cache, batch, layer, **extra)


@functools.cache  # per method: asked at every layer of every step
def _takes(method: Any) -> frozenset[str]:
    params = inspect.signature(method).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return frozenset({"query", "observe", "mass"})
    return frozenset(params)
