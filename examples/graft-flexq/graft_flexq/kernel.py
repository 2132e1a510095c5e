"""Triton kernels of `flexq` and their launchers (`kernel: triton` in the parameters).

On a machine without a GPU they run under TRITON_INTERPRET=1 (the conformance kit sets
it): fp32/fp16 only, small shapes. Import triton inside the launchers, not at module level,
so the reference path never needs it.
"""
from __future__ import annotations


def quantize(plugin, weight):
    """The Triton path of Flexq.quantize (same inputs and result as the reference)."""
    raise NotImplementedError("flexq: write the Triton kernel for quantize() in graft_flexq/kernel.py")


def apply(plugin, tensors: dict, x, bias):
    """The Triton path of Flexq.apply (same inputs and result as the reference)."""
    raise NotImplementedError("flexq: write the Triton kernel for apply() in graft_flexq/kernel.py")
