"""Hydragen's log-sum-exp merge by FlashInfer's ``cascade.merge_state``, where it may run.

The Triton launcher (``kernel.py``) computes, per new token and head, the suffix partial
``(o_s, lse_s)`` and one prefix partial ``(o_p[r], lse_p[r])`` per tree level the token is in
(rows ``part_rows[part_start[t]:part_start[t + 1]]``). :func:`merge_partials` folds them as
``_merge_kernel`` does, one ``merge_state`` per level:

* ``merge_state(v_a, s_a, v_b, s_b)`` takes ``v`` as fp16/bf16 ``[tokens, heads, D]`` and ``s`` as
  float32 ``[tokens, heads]``, contiguous, on CUDA (flashinfer/cascade.py:42-95,
  data/csrc/cascade.cu:25-57), and ``s`` is a base-2 log-sum-exp (cascade.cuh:58-72); our
  partials' lse are natural logs, so they are scaled by log2(e).
* A token with fewer levels than the deepest merges, at the levels it lacks, a padding row of
  lse = -inf (weight exp2(-inf) = 0).

So the path runs for fp16/bf16 queries only; fp32 keeps the Triton merge (logged once).
"""

from __future__ import annotations

import torch

from ... import _flashinfer
from .policy import StepPlan

_decided: dict[tuple[str, torch.dtype], bool] = {}


def use_flashinfer_merge(query: torch.Tensor) -> bool:
    """Whether the merge runs in FlashInfer for this device and dtype (decided once, logged once)."""
    key = (str(query.device), query.dtype)
    got = _decided.get(key)
    if got is None:
        reason = _flashinfer.unavailable(query)
        if reason is None and query.dtype not in (torch.float16, torch.bfloat16):
            reason = f"merge_state takes fp16/bf16 outputs (data/csrc/cascade.cu:47), the query is {query.dtype}"
        got = _decided[key] = _flashinfer.choose(
            "hydragen merge", reason, "cascade.merge_state", "the Triton merge kernel"
        )
    return got


def _levels(ix: dict, plan: StepPlan, block_size: int, pad: int, device: torch.device) -> list[torch.Tensor]:
    """Per tree level, each token's prefix-partial row at that level (``pad`` where it has none);
    built on the device from the launcher's part_start/part_rows, once per step."""
    key = ("flashinfer-levels", block_size, str(device))
    got = plan.cache.get(key)
    if got is None:
        depth = plan.prefixes(block_size).depth if ix["num_groups"] else 0
        start = ix["part_start"][:-1].long()
        count = ix["part_start"][1:].long() - start
        rows = ix["part_rows"].long()
        last = rows.numel() - 1
        got = [torch.where(count > j, rows[(start + j).clamp(max=last)], pad) for j in range(depth)]
        plan.cache[key] = got
    return got


def merge_partials(
    o_s: torch.Tensor,
    lse_s: torch.Tensor,
    o_p: torch.Tensor,
    lse_p: torch.Tensor,
    ix: dict,
    plan: StepPlan,
    block_size: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """``out`` = the suffix partial merged with each token's prefix partials (natural-log lse in,
    ``out.dtype`` out), by ``flashinfer.cascade.merge_state``."""
    from flashinfer.cascade import merge_state

    nr = o_p.shape[0]
    v = o_s.to(out.dtype)
    s = lse_s * _flashinfer.LOG2E
    levels = _levels(ix, plan, block_size, nr, o_s.device)
    if levels:
        vp = torch.zeros((nr + 1, *o_p.shape[1:]), dtype=out.dtype, device=o_p.device)
        vp[:nr] = o_p
        sp = torch.full((nr + 1, lse_p.shape[1]), float("-inf"), dtype=torch.float32, device=lse_p.device)
        torch.mul(lse_p, _flashinfer.LOG2E, out=sp[:nr])
        for idx in levels:
            v, s = merge_state(v, s, vp.index_select(0, idx), sp.index_select(0, idx))
    out.copy_(v)
    return out
