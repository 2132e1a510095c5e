"""Fused softmax top-k with confidence pruning, as one Triton kernel (see ``reference.py``
for the semantics: the kernel computes exactly ``dynamic_topk``).

Shapes: ``logits [T, E]`` (fp32 or fp16, row stride ``stride_t``) -> ``weights [T, K]`` fp32,
``ids [T, K]`` int32, ``kept [T]`` int32. One program handles ``BLOCK_T`` tokens; the expert
axis is padded to ``BLOCK_E`` (a power of two >= E) with ``-inf``. The k largest are found by
k rounds of (max, first index of the max, knock it out), so ties go to the lower expert id
(``torch.topk`` on CPU does the same for the shapes tested).

On a machine without a GPU this runs only under ``TRITON_INTERPRET=1`` (slow: an exactness
check, not a fast path); the plugin uses the reference unless ``kernel: triton`` is set.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _pop_max(work, cols, BLOCK_E: tl.constexpr):
    """Each row's largest value, the lowest column holding it (int32), and ``work`` with that
    column knocked out (-inf)."""
    v = tl.max(work, axis=1)
    idx = tl.min(tl.where(work == v[:, None], cols[None, :], BLOCK_E), axis=1).to(tl.int32)
    return v, idx, tl.where(cols[None, :] == idx[:, None], float("-inf"), work)


@triton.jit
def _keep_slot(share, before, confident, threshold, FORCED: tl.constexpr, ENTROPY: tl.constexpr):
    """Whether each row keeps its next slot: always among the first ``min_k`` (``FORCED``); else,
    by entropy, while the row is not confident, or, by mass, while the share ranked before it
    is under the threshold."""
    if ENTROPY:
        keep = ~confident
    else:
        keep = before < threshold
    if FORCED:
        keep = share == share  # always (a [BLOCK_T] true)
    return keep


@triton.jit
def _dynamic_topk_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    kept_ptr,
    T,
    E,
    stride_t,
    threshold,
    inv_log_e,
    K: tl.constexpr,
    MIN_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    ENTROPY: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    mask = row_ok[:, None] & (cols[None, :] < E)
    x = tl.load(logits_ptr + rows[:, None] * stride_t + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)

    # softmax statistics over all E experts
    m = tl.max(x, axis=1)
    ex = tl.where(mask, tl.exp(x - m[:, None]), 0.0)
    z = tl.sum(ex, axis=1)
    if ENTROPY:
        p = ex / z[:, None]
        plogp = tl.where(p > 0, p * tl.log(tl.where(p > 0, p, 1.0)), 0.0)
        ent = -tl.sum(plogp, axis=1) * inv_log_e
        confident = ent < threshold
    else:
        confident = row_ok  # unread: the mass criterion keeps by the mass ranked before a slot

    # The k largest by repeated (max, lowest index of the max, knock it out: _pop_max), done in
    # three passes so everything stays in registers: (1) the top-k mass, (2) which slots are kept
    # (_keep_slot) and their weight sum, (3) the final weights and ids.
    work = x
    top_sum = tl.zeros([BLOCK_T], dtype=tl.float32)
    for j in tl.static_range(K):
        v, idx, work = _pop_max(work, cols, BLOCK_E)
        top_sum += tl.exp(v - m)

    work = x
    before = tl.zeros([BLOCK_T], dtype=tl.float32)
    kept_sum = tl.zeros([BLOCK_T], dtype=tl.float32)
    kept = tl.zeros([BLOCK_T], dtype=tl.int32)
    for j in tl.static_range(K):
        v, idx, work = _pop_max(work, cols, BLOCK_E)
        share = tl.exp(v - m) / top_sum
        keep = _keep_slot(share, before, confident, threshold, j < MIN_K, ENTROPY)
        before += share
        kept += keep.to(tl.int32)
        if RENORMALIZE:
            kept_sum += tl.where(keep, share, 0.0)

    work = x
    before = tl.zeros([BLOCK_T], dtype=tl.float32)
    first = tl.zeros([BLOCK_T], dtype=tl.int32)
    for j in tl.static_range(K):
        v, idx, work = _pop_max(work, cols, BLOCK_E)
        if j == 0:
            first = idx
        e = tl.exp(v - m)
        share = e / top_sum
        keep = _keep_slot(share, before, confident, threshold, j < MIN_K, ENTROPY)
        before += share
        if RENORMALIZE:
            w = tl.where(keep, share / kept_sum, 0.0)
        else:
            w = tl.where(keep, e / z, 0.0)
        tl.store(ids_ptr + rows * K + j, tl.where(keep, idx, first), mask=row_ok)
        tl.store(weights_ptr + rows * K + j, w, mask=row_ok)
    tl.store(kept_ptr + rows, kept, mask=row_ok)


def dynamic_topk_triton(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    *,
    threshold: float,
    criterion: str = "mass",
    min_k: int = 1,
    block_t: int | None = None,
):
    """Launcher: same arguments and results as ``reference.dynamic_topk`` (ids and kept as
    int32 here)."""
    if criterion not in ("mass", "entropy"):
        raise ValueError(f"unknown criterion {criterion!r}; accepted: mass, entropy")
    if router_logits.dtype not in (torch.float32, torch.float16):
        raise TypeError(
            f"dynamic_topk_triton takes fp32/fp16 logits, got {router_logits.dtype} "
            "(bf16 is not reliable under TRITON_INTERPRET)"
        )
    x = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    T, E = x.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k {top_k} must be in 1..{E}")
    weights = torch.empty((T, top_k), dtype=torch.float32, device=x.device)
    ids = torch.empty((T, top_k), dtype=torch.int32, device=x.device)
    kept = torch.empty((T,), dtype=torch.int32, device=x.device)
    if T == 0:
        return weights, ids, kept
    block_e = triton.next_power_of_2(E)
    # tile: ~4K logits per program (E=8 -> 512 tokens; E=64 -> 64 tokens)
    bt = block_t or max(1, min(triton.next_power_of_2(T), 4096 // block_e))
    grid = (triton.cdiv(T, bt),)
    _dynamic_topk_kernel[grid](
        x,
        weights,
        ids,
        kept,
        T,
        E,
        x.stride(0),
        float(threshold),
        1.0 / math.log(E) if E > 1 else 0.0,
        K=top_k,
        MIN_K=max(1, min(min_k, top_k)),
        BLOCK_T=bt,
        BLOCK_E=block_e,
        ENTROPY=criterion == "entropy",
        RENORMALIZE=bool(renormalize),
    )
    return weights, ids, kept
