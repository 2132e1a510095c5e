"""Triton kernel for Token Recycling's tensor-shaped step: the top-k update of the
successor matrix from the verify step's logits.

``recycle_update(logits [R, V], tokens [R], matrix [rows, k])`` does, in one launch,
``matrix[tokens[r]] = topk(logits[r], k)`` for every row ``r``: one program per row finds
the ``k`` largest logits by ``k`` passes of a blocked argmax over the vocabulary, each pass
taking the next element in the order (value descending, token id ascending), and writes
them into the row of ``tokens[r]``. Nothing of the logits leaves the device. Where a token
repeats in ``tokens``, only its last row is written (the launcher masks the others, so the
result does not depend on program order), as in :func:`..reference.topk_update_reference`.

On the vLLM CPU engine the adapter hands the plugin top-k ids already (``torch.topk``);
this kernel is the device-side path (:meth:`..reference.TokenRecycling.update_from_logits`
with CUDA tensors) and is tested against the reference under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _recycle_update_kernel(
    logits_ptr, tokens_ptr, write_ptr, matrix_ptr, V, stride_l, stride_m, K: tl.constexpr, BLOCK_V: tl.constexpr
):
    r = tl.program_id(0)
    if tl.load(write_ptr + r) != 0:
        tok = tl.load(tokens_ptr + r).to(tl.int64)
        row = logits_ptr + r.to(tl.int64) * stride_l
        big = V + 1
        prev_val = float("inf")
        prev_idx = -1
        for j in tl.static_range(K):
            best_val = -float("inf")
            best_idx = big
            for start in range(0, V, BLOCK_V):
                offs = start + tl.arange(0, BLOCK_V)
                inb = offs < V
                x = tl.load(row + offs, mask=inb, other=-float("inf")).to(tl.float32)
                # not yet taken: after (prev_val, prev_idx) in (value desc, id asc) order
                ok = inb & ((x < prev_val) | ((x == prev_val) & (offs > prev_idx)))
                xm = tl.where(ok, x, -float("inf"))
                m = tl.max(xm, axis=0)
                i = tl.min(tl.where(ok & (xm == m), offs, big), axis=0)
                better = (m > best_val) | ((m == best_val) & (i < best_idx))
                best_val = tl.where(better, m, best_val)
                best_idx = tl.where(better, i, best_idx)
            tl.store(matrix_ptr + tok * stride_m + j, best_idx.to(tl.int64))
            prev_val = best_val
            prev_idx = best_idx


def last_occurrence(tokens: torch.Tensor) -> torch.Tensor:
    """int8 mask: 1 where row r is the last row of its token in ``tokens``."""
    r = tokens.numel()
    pos = torch.arange(r, device=tokens.device)
    last = torch.full((int(tokens.max()) + 1,), -1, dtype=torch.long, device=tokens.device)
    last.scatter_reduce_(0, tokens.long(), pos, reduce="amax")
    return (last[tokens.long()] == pos).to(torch.int8)


def recycle_update(
    logits: torch.Tensor, tokens: torch.Tensor, matrix: torch.Tensor, block_v: int = 1024
) -> torch.Tensor:
    """``matrix[tokens[r]] = topk(logits[r])`` for each row (see module docstring); in place."""
    if logits.ndim != 2 or tokens.ndim != 1 or logits.shape[0] != tokens.shape[0]:
        raise ValueError(f"logits [R, V] and tokens [R] expected, got {tuple(logits.shape)} and {tuple(tokens.shape)}")
    if matrix.dtype != torch.int64 or matrix.ndim != 2 or matrix.stride(1) != 1:
        raise ValueError("matrix must be a row-major int64 [rows, k] tensor")
    k, v = matrix.shape[1], logits.shape[1]
    if k > v:
        raise ValueError(f"k={k} exceeds the vocabulary {v}")
    if tokens.numel() == 0:
        return matrix
    if int(tokens.max()) >= matrix.shape[0] or int(tokens.min()) < 0:
        raise ValueError(f"token ids must be in [0, {matrix.shape[0]})")
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    write = last_occurrence(tokens)
    block = min(triton.next_power_of_2(v), block_v)
    _recycle_update_kernel[(logits.shape[0],)](
        logits, tokens, write, matrix, v, logits.stride(0), matrix.stride(0), K=k, BLOCK_V=block
    )
    return matrix
