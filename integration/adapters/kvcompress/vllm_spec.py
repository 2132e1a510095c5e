"""The scheduler half of the kvcompress adapter in vLLM (see "vLLM route" in the package doc):
:class:`GraftKVCompressSpec`, the full-attention KV-cache spec of a compressed layer, and its
manager :class:`GraftKVCompressManager`, which frees the blocks the compressor does not keep;
:func:`customize_spec` (the backend's seam) and :func:`register_spec`.

Imports vLLM: the adapter (:mod:`.engine`) imports this module when a deployment activates
it. The classes are module-level so that they unpickle by name in any vLLM process.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from . import state as _state
from .channel import trace
from .plan import KVCompressError, blocks_to_free, runs


@dataclass(frozen=True, kw_only=True)
class GraftKVCompressSpec(FullAttentionSpec):
    """Full attention whose blocks a vllm-graft KV compressor frees."""

    compressor: str = ""  # the plugin's name (no vLLM config is current where specs are built)
    kv_format: str = ""  # the storage format's name ("": dense K/V in the model's dtype)

    @classmethod
    def merge(cls, specs):
        names = {(s.compressor, s.kv_format) for s in specs}
        if len(names) != 1:
            raise ValueError(f"layers of one KV cache group name different compressors: {sorted(names)}")
        name, kv_format = names.pop()
        # FullAttentionSpec.merge builds cls(...) from its own fields only (dtype and
        # state_content_bytes, which carry a storage format's page size, included).
        return replace(super().merge(specs), compressor=name, kv_format=kv_format)


class GraftKVCompressManager(FullAttentionManager):
    """Frees, each step, the blocks the compressor does not keep."""

    def remove_skipped_blocks(self, request_id, processed_computed_tokens, num_prompt_tokens=None):
        super().remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)
        blocks = self.req_to_blocks.get(request_id)
        if not blocks or processed_computed_tokens <= 0 or num_prompt_tokens is None:
            return
        state = _state.current(self.kv_cache_spec.compressor)
        if state.needs_scores:
            self._free_reported(request_id, blocks, state)
            return
        free = blocks_to_free(
            state.compressor,
            state.name,
            num_tokens=processed_computed_tokens,
            block_size=self.block_size,
            num_prompt_tokens=num_prompt_tokens,
            held=[(b.is_null, b.ref_cnt) for b in blocks],
            request_id=request_id,
        )
        if free is None:
            return
        state.count("steps", 1)
        for start, end in reversed(runs(free)):
            self._remove_blocks_in_range(request_id, start, end)
        if free:
            state.count("blocks_freed", len(free))
            # for the worker's check (channel.after_schedule_wrapper puts it on the SchedulerOutput)
            state.freed_now.setdefault(request_id, {}).setdefault(self.block_size, []).extend(free)

    def _free_reported(self, request_id, blocks, state):
        """Scored compressors: free what the worker reported dropped, except blocks
        still shared through the prefix cache (freed once no longer shared)."""
        pending = state.to_free.get(request_id)
        if not pending:
            return
        free = sorted(i for i in pending if i < len(blocks) and not blocks[i].is_null and blocks[i].ref_cnt <= 1)
        pending.difference_update(free)
        pending.difference_update([i for i in pending if i < len(blocks) and blocks[i].is_null])
        state.count("steps", 1)
        for start, end in reversed(runs(free)):
            self._remove_blocks_in_range(request_id, start, end)
        if free:
            state.count("blocks_freed", len(free))
            trace("scheduler_freed", len(free))

    def free(self, request_id):
        active = _state.get_active()
        if active is not None:
            active.to_free.pop(request_id, None)
            active.freed_now.pop(request_id, None)
        return super().free(request_id)


def customize_spec(spec: Any) -> Any:
    """The backend's ``customize_spec`` seam: plain full attention becomes compressible."""
    if (
        type(spec) is not FullAttentionSpec
        or spec.sliding_window is not None
        or spec.attention_chunk_size is not None
        or spec.non_causal
    ):
        return spec  # other layer kinds are not compressed
    active = _state.get_active()
    name = active.spec_name if active is not None else ""
    values = {f.name: getattr(spec, f.name) for f in fields(spec) if f.init}
    fmt = active.kv_format if active is not None else None
    if active is not None and fmt is not None:
        why = fmt.unsupported(spec.head_size, spec.block_size)
        if why is None and spec.head_size_v != spec.head_size:
            why = f"key and value head sizes differ ({spec.head_size} vs {spec.head_size_v})"
        if why is not None:
            raise KVCompressError(
                f"kvcompress storage format {active.format_name!r} cannot store this model's KV cache: {why}"
            )
        # the format's page: uint8 rows of bytes_per_token per token and KV head; vLLM sizes
        # its pages, and so the number of blocks in the KV memory, from these two fields
        values.update(
            dtype=torch.uint8,
            state_content_bytes=fmt.bytes_per_token(spec.head_size, spec.block_size),
            page_size_padded=None,
        )
        return GraftKVCompressSpec(**values, compressor=name, kv_format=active.format_name)
    return GraftKVCompressSpec(**values, compressor=name)


def register_spec() -> None:
    """Register the spec and its manager with vLLM (idempotent)."""
    # The built-in specs register only into an empty registry: fill it first.
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(GraftKVCompressSpec, GraftKVCompressManager, uniform_type_base_spec=FullAttentionSpec)
