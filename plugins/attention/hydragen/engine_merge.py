"""Hydragen's log-sum-exp merge by the serving engine's own kernel, where the route provides one
(vLLM's ``merge_attn_states``: on CUDA its CUDA kernel, or its Triton one; see
:data:`~vllm_graft.hooks.contracts.attention.HOST_KERNELS`). First choice on CUDA; FlashInfer's
``merge_state`` (``flashinfer.py``) where vLLM gives none, then hydragen's own Triton merge.

vLLM merges two partials per call, with natural-log lse laid out ``[heads, tokens]``; a token's
prefix partials (one per tree level, rows ``part_rows[part_start[t]:part_start[t + 1]]``) are
folded in one call per level, as FlashInfer's path does, a token without a partial at a level
taking a padding row of lse = -inf (weight 0). The running partial stays float32 and goes to
``out.dtype`` once, at the end.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from vllm_graft.hooks.contracts.attention import host_kernel

from .flashinfer import _levels
from .policy import StepPlan

log = logging.getLogger("vllm_graft")
_said: set[str] = set()


def engine_merge() -> Any:
    """The engine's merge kernel, or None (logged once when first used)."""
    merge = host_kernel("merge_attn_states")
    if merge is not None and "engine" not in _said:
        _said.add("engine")
        log.info("vllm-graft hydragen merge: vLLM's merge_attn_states")
    return merge


def merge_partials_with(merge: Any, partials: tuple, ix: dict, plan: StepPlan, block_size: int, out: torch.Tensor):
    """``out`` = the suffix partial merged with each token's prefix partials by ``merge`` (vLLM's
    signature); ``partials`` = ``(o_s [T, H, D], lse_s [T, H], o_p [R, H, D], lse_p [R, H])``."""
    o_s, lse_s, o_p, lse_p = partials
    nr = o_p.shape[0]
    v = o_s.float().contiguous()
    s = lse_s.float().t().contiguous()  # [H, T]
    levels = _levels(ix, plan, block_size, nr, o_s.device)
    if levels:
        vp = torch.zeros((nr + 1, *o_p.shape[1:]), dtype=torch.float32, device=o_p.device)
        vp[:nr] = o_p
        sp = torch.full((nr + 1, lse_p.shape[1]), float("-inf"), dtype=torch.float32, device=lse_p.device)
        sp[:nr] = lse_p
        for idx in levels:
            merged, merged_lse = torch.empty_like(v), torch.empty_like(s)
            merge(
                merged, vp.index_select(0, idx), sp.index_select(0, idx).t().contiguous(), v, s, output_lse=merged_lse
            )
            v, s = merged, merged_lse
    out.copy_(v)
    return out
