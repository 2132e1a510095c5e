"""Hydragen's log-sum-exp merge by the serving engine's own kernel, where the route provides one
(vLLM's ``merge_attn_states``: on CUDA its CUDA kernel, or its Triton one; see
:data:`~vllm_graft.hooks.contracts.attention.HOST_KERNELS`). First choice on CUDA; FlashInfer's
``merge_state`` (``flashinfer.py``) where vLLM gives none, then hydragen's own Triton merge.

vLLM merges two partials per call, with natural-log lse laid out ``[heads, tokens]``; a token's
prefix partials (one per tree level, rows ``part_rows[part_start[t]:part_start[t + 1]]``) are
folded in one call per level (``levels.py``, shared with FlashInfer's path). The running partial
stays float32 and goes to ``out.dtype`` once, at the end.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ....hooks.contracts.attention import host_kernel

from .levels import fold_levels
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

    def merge_two(v: torch.Tensor, s: torch.Tensor, v_level: torch.Tensor, s_level: torch.Tensor):
        merged, merged_lse = torch.empty_like(v), torch.empty_like(s.t().contiguous())  # vLLM's lse: [H, T]
        merge(merged, v_level, s_level.t().contiguous(), v, s.t().contiguous(), output_lse=merged_lse)
        return merged, merged_lse.t()

    out.copy_(fold_levels(partials, ix, plan, block_size, torch.float32, 1.0, merge_two))
    return out
