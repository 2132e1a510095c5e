"""Code the quantisation methods share, in plain PyTorch (what a method's reference and its
Triton kernel both need lives here, so that ``kernel.py`` never imports ``reference.py``):

* :func:`quantize_activations`: symmetric int8 activations per token (the A8 of W4A8; the W4A8
  reference's integer-GEMM emulation and its Triton GEMM both quantise ``x`` with it).
"""
from __future__ import annotations

import torch


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per token (row): ``(int8 values, fp32 step [M, 1])``."""
    x = x.float()
    s = (x.abs().amax(-1, keepdim=True) / 127).clamp_min(1e-8)
    return torch.round(x / s).clamp(-127, 127).to(torch.int8), s
