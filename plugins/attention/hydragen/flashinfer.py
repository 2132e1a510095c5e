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
from .levels import fold_levels
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

    def merge_two(v, s, v_level, s_level):  # the call written out: the doctor checks it against the wheel
        return merge_state(v, s, v_level, s_level)

    out.copy_(fold_levels((o_s, lse_s, o_p, lse_p), ix, plan, block_size, out.dtype, _flashinfer.LOG2E, merge_two))
    return out
