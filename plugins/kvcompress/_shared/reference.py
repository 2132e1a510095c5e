"""``KVCompressor.attend`` of the scored compressors (``h2o``, ``snapkv``, and per KV head
``adakv``): the layer's exact attention and the softmax mass the observed queries put on each
block.

``kernel: reference`` runs the attention kind's shared exact attention with mass (the oracle
and the CPU path); ``kernel: triton`` the decode kernel of :mod:`.kernel` (imported here, only
when chosen, so Triton is imported after ``TRITON_INTERPRET`` is set), which sends the rows with
several queries to the same reference.
"""

from __future__ import annotations

import torch

from ....hooks import AttentionLayer, PagedBatch
from ...attention._shared import paged_attention_with_mass


def attend(
    kernel: str,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: PagedBatch,
    layer: AttentionLayer,
    observe: torch.Tensor,
    head_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, H, D], mass [num_seqs, max_blocks])`` by the path ``kernel`` names; with
    ``head_mask [num_seqs, H_kv, max_blocks]`` (per-head compressors) each KV head reads only
    its blocks and the mass is ``[num_seqs, H_kv, max_blocks]``."""
    if kernel == "triton":
        from .kernel import attention_with_mass

        return attention_with_mass(query, kv_cache, batch, layer, observe, head_mask=head_mask)
    return paged_attention_with_mass(query, kv_cache, batch, layer, observe, head_mask=head_mask)


def live_slots(
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache: torch.Tensor,
    row_bytes: int,
    what: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A storage format's write rows: ``(blocks, offsets, key, value)`` of the first
    ``slot_mapping.shape[0]`` tokens whose slot is not padding (negative), or None when none is;
    a ValueError first when the uint8 cache ``[N, H_kv, B, C]`` does not have the ``row_bytes``
    that ``what`` ("kv4: ... for head size D, ...") gives. (One host sync per call, as vLLM's own
    CPU write has; kv4 and million share it.)"""
    return live_rows(slot_mapping, kv_cache, row_bytes, what, key, value)


def live_rows(
    slot_mapping: torch.Tensor, kv_cache: torch.Tensor, row_bytes: int, what: str, *per_token: torch.Tensor
) -> tuple[torch.Tensor, ...] | None:
    """:func:`live_slots` for any tensors of per-token rows: ``(blocks, offsets, *per_token)``
    of the tokens whose slot is not padding (xquant's encoded rows)."""
    C, block_size = kv_cache.shape[-1], kv_cache.shape[2]
    if C != row_bytes:
        name, _, layout = what.partition(": ")
        raise ValueError(f"{name}: cache rows of {C} bytes, expected {row_bytes} {layout}")
    n = slot_mapping.shape[0]
    slots = slot_mapping[:n].long()
    rows = [t[:n] for t in per_token]
    valid = slots >= 0
    if not bool(valid.all()):
        slots, rows = slots[valid], [t[valid] for t in rows]
    if slots.numel() == 0:
        return None
    return (slots // block_size, slots % block_size, *rows)
