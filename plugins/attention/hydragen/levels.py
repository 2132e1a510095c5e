"""Folding hydragen's partials level by level, for the merges done by someone else's kernel
(vLLM's ``merge_attn_states`` in ``engine_merge.py``, FlashInfer's ``merge_state`` in
``flashinfer.py``): each token's suffix partial is merged with its prefix partial at each tree
level in turn (rows ``part_rows[part_start[t]:part_start[t + 1]]``), a token without a partial at a
level taking a padding row of lse = -inf (weight 0)."""

from __future__ import annotations

from typing import Callable

import torch

from .policy import StepPlan


def level_rows(ix: dict, plan: StepPlan, block_size: int, pad: int, device: torch.device) -> list[torch.Tensor]:
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


Merge2 = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def fold_levels(
    partials: tuple, ix: dict, plan: StepPlan, block_size: int, dtype: torch.dtype, lse_scale: float, merge_two: Merge2
) -> torch.Tensor:
    """The merged output, in ``dtype``. ``partials`` = ``(o_s [T, H, D], lse_s [T, H], o_p [R, H, D],
    lse_p [R, H])`` with natural-log lse, scaled by ``lse_scale`` (FlashInfer's lse is base 2);
    ``merge_two(v, s, v_level, s_level)`` merges two partials (values in ``dtype``, float32 lse
    ``[T, H]``) and returns the merged pair."""
    o_s, lse_s, o_p, lse_p = partials
    nr = o_p.shape[0]
    v = o_s.to(dtype)
    s = lse_s * lse_scale
    levels = level_rows(ix, plan, block_size, nr, o_s.device)
    if levels:
        vp = torch.zeros((nr + 1, *o_p.shape[1:]), dtype=dtype, device=o_p.device)
        vp[:nr] = o_p
        sp = torch.full((nr + 1, lse_p.shape[1]), float("-inf"), dtype=torch.float32, device=lse_p.device)
        torch.mul(lse_p, lse_scale, out=sp[:nr])
        for idx in levels:
            v, s = merge_two(v, s, vp.index_select(0, idx), sp.index_select(0, idx))
    return v
