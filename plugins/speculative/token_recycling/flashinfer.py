"""Token Recycling's matrix update with FlashInfer's ``top_k`` where it may run.

:func:`recycle_update` is what the plugin calls for CUDA logits: ``matrix[tokens[r]] =
topk(logits[r], k)`` (value descending, id ascending; a repeated token: its last row wins), as
:func:`.kernel.recycle_update` (Triton) and :func:`.reference.topk_update_reference` do. The
top-k comes from ``flashinfer.top_k`` (flashinfer/topk.py:876-883) when
:func:`vllm_graft.plugins._flashinfer.unavailable` allows; otherwise the Triton kernel runs, and
the reason is logged once.
"""

from __future__ import annotations

import torch

from ... import _flashinfer


def recycle_update(logits: torch.Tensor, tokens: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """In place; see the module docstring."""
    reason = _flashinfer.unavailable(logits)
    if reason is None and logits.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        reason = f"top_k takes float32/float16/bfloat16 logits, not {logits.dtype}"
    if not _flashinfer.choose("token-recycling top-k", reason, "top_k", "the Triton top-k kernel"):
        from .kernel import recycle_update as triton_update

        return triton_update(logits, tokens, matrix)
    if logits.ndim != 2 or tokens.ndim != 1 or logits.shape[0] != tokens.shape[0]:
        raise ValueError(f"logits [R, V] and tokens [R] expected, got {tuple(logits.shape)} and {tuple(tokens.shape)}")
    k = matrix.shape[1]
    if k > logits.shape[1]:
        raise ValueError(f"k={k} exceeds the vocabulary {logits.shape[1]}")
    if tokens.numel() == 0:
        return matrix
    ids = _flashinfer.topk_ids(logits, k)
    rows = tokens.long()
    pos = torch.arange(rows.numel(), device=rows.device)
    last = torch.full((matrix.shape[0],), -1, dtype=torch.long, device=rows.device)
    last.scatter_reduce_(0, rows, pos, reduce="amax")
    # every row of a repeated token writes its last row's ids: the same value, so the order of
    # the duplicate writes does not matter
    matrix[rows] = ids[last[rows]].to(matrix.dtype)
    return matrix
