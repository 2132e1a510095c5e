"""Exact attention over vLLM's paged KV cache, for plugin authors: the PyTorch reference the
built-in plugins use (``noop`` attention, the ``forward`` of ``h2o``/``snapkv``/``adakv``'s
:meth:`~vllm_graft.hooks.KVCompressor.attend`), and the Triton decode kernel that also reports
the attention mass per block (``h2o``/``snapkv``/``adakv`` with ``kernel: triton``).

``from vllm_graft.plugins.paged import paged_attention_with_mass`` (plugins may import
``vllm_graft.plugins``; ``vllm_graft.hooks`` never does, so these are not exported there).
Importing this module imports torch, not Triton: the kernel's launcher imports Triton when
first called, so set ``TRITON_INTERPRET=1`` before that on a machine without a GPU.

Shapes (vLLM's, see :mod:`vllm_graft.hooks.contracts`): ``query [T, H, D]`` (every sequence's
new tokens packed), ``kv_cache [num_blocks, H_kv, block_size, 2*D]`` in the layout
``layer.kv_layout`` says (:class:`~vllm_graft.hooks.KVCacheLayout`: blocked or packed, any
physical order; every function here reads it through ``layer.kv_layout.split``, so a plugin built
on them may claim ``kv_layouts = ("blocked", "packed")``), a
:class:`~vllm_graft.hooks.PagedBatch` (``query_start_loc``, ``seq_lens``, ``block_table``) and
the :class:`~vllm_graft.hooks.AttentionLayer` (``scale``, ``num_kv_heads``...). GQA: query head
``h`` reads KV head ``h // (H / H_kv)``. Results are computed in float32; ``out`` has the
query's dtype, ``mass`` is float32 on the query's device.

* :func:`paged_attention` -> ``out [T, H, D]``: causal attention of each sequence's queries
  (its last positions) over its ``seq_lens[i]`` keys;
* :func:`paged_attention_with_mass` -> ``(out, mass [num_seqs, max_blocks])``: the same and
  the softmax probability the queries with ``observe[t]`` True put on each block-table column,
  summed over heads and those queries: exactly what :meth:`KVCompressor.attend` returns, so a
  scored compressor's ``attend`` can be this one call; with ``head_mask [num_seqs, H_kv,
  max_blocks]`` (a per-head compressor's) each KV head reads only its blocks and ``mass`` is
  per KV head, ``[num_seqs, H_kv, max_blocks]``;
* :func:`attention_with_mass` -> the same, by the path a ``kernel`` parameter names
  (``"reference"``: :func:`paged_attention_with_mass`; ``"triton"``:
  :func:`triton_attention_with_mass`), for a compressor whose parameters derive from
  :class:`~vllm_graft.hooks.KernelParams`: ``attention_with_mass(..., kernel=self.params.kernel)``;
* :func:`triton_attention_with_mass`: the Triton launcher (decode rows, one query each, in the
  kernel; rows with several queries through the reference). Block size and head size must be
  powers of two;
* :func:`causal_attention`, :func:`gather_kv` (pass ``layer.kv_layout``): one sequence at a time,
  for a plugin's own loop.

Example, a scored compressor (``needs_scores``)::

    from vllm_graft.plugins.paged import paged_attention_with_mass

    class MyScorer(KVCompressor):
        needs_scores = True
        kv_layouts = ("blocked", "packed")  # it reads only through paged_attention_with_mass

        def attend(self, query, kv_cache, batch, layer, observe):
            return paged_attention_with_mass(query, kv_cache, batch, layer, observe)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .attention._shared import (
    Gather,
    causal_attention,
    gather_kv,
    paged_attention,
    paged_attention_with_mass,
)

if TYPE_CHECKING:
    import torch

    from ..hooks import AttentionLayer, PagedBatch


def triton_attention_with_mass(
    query: "torch.Tensor",
    kv_cache: "torch.Tensor",
    batch: "PagedBatch",
    layer: "AttentionLayer",
    observe: "torch.Tensor",
    head_mask: "torch.Tensor | None" = None,
) -> tuple["torch.Tensor", "torch.Tensor"]:
    """:func:`paged_attention_with_mass` with the Triton decode kernel for the rows that have
    one query (decode), the reference for the others; same arguments and result (to float
    rounding). Imports Triton on its first call."""
    from .kvcompress._shared.kernel import attention_with_mass as launch

    return launch(query, kv_cache, batch, layer, observe, head_mask=head_mask)


def attention_with_mass(
    query: "torch.Tensor",
    kv_cache: "torch.Tensor",
    batch: "PagedBatch",
    layer: "AttentionLayer",
    observe: "torch.Tensor",
    head_mask: "torch.Tensor | None" = None,
    kernel: str = "reference",
) -> tuple["torch.Tensor", "torch.Tensor"]:
    """``(out, mass)`` as :func:`paged_attention_with_mass`, by the path ``kernel`` names:
    ``"reference"`` (PyTorch) or ``"triton"`` (:func:`triton_attention_with_mass`)."""
    if kernel == "triton":
        return triton_attention_with_mass(query, kv_cache, batch, layer, observe, head_mask=head_mask)
    if kernel != "reference":
        raise ValueError(f"kernel {kernel!r}: use 'reference' or 'triton'")
    return paged_attention_with_mass(query, kv_cache, batch, layer, observe, head_mask=head_mask)


__all__ = [
    "Gather",
    "attention_with_mass",
    "causal_attention",
    "gather_kv",
    "paged_attention",
    "paged_attention_with_mass",
    "triton_attention_with_mass",
]
