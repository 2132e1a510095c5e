"""The reference implementation of `flexq`: plain PyTorch, readable beside the paper.

Weights: per output channel ``o``, ``scale[o] = max|W[o]| / qmax_w`` and
``qweight = round(W / scale)`` clipped to ``[-qmax_w, qmax_w]`` (``qmax = 2**(bits-1) - 1``:
31 for 6 bits), stored in an int8 tensor (6 significant bits; packing four weights into
three bytes is left out). Activations: per token ``t``, the same with ``qmax_a`` (127 for
8 bits), at every call. The product is an integer GEMM (``qx @ qweight.T``, exact: it is
accumulated in float32 well below 2**24) rescaled by ``sx[t] * scale[o]``.
"""
from __future__ import annotations

import torch

from vllm_graft.hooks import QuantMethod


def qmax(bits: int) -> int:
    return 2 ** (bits - 1) - 1


def quantize_rows(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row quantisation: (int8 values, float32 scale per row)."""
    x = x.float()
    scale = x.abs().amax(dim=-1).clamp(min=1e-8) / qmax(bits)
    q = torch.round(x / scale[..., None]).clamp(-qmax(bits), qmax(bits)).to(torch.int8)
    return q, scale


def int_gemm(qx: torch.Tensor, sx: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
             bias: torch.Tensor | None) -> torch.Tensor:
    """``(qx @ qweight.T) * sx[:, None] * scale[None, :] + bias`` in float32."""
    acc = qx.float() @ qweight.float().T
    out = acc * sx[:, None] * scale[None, :]
    return out + bias.float() if bias is not None else out


class FlexQ(QuantMethod):
    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        qweight, scale = quantize_rows(weight, self.params.weight_bits)
        return {"qweight": qweight, "scale": scale}

    def error_bound(self, layer: str) -> float:
        """Symmetric rounding to b bits per row errs about 2**-b relative: measured on the kit's
        layers at w8a8 0.010, w6a8 0.029 (the default), w4a8 0.124, w3a4 0.33 (every dtype, the
        structured layer below the random ones), so 4 x 2**-weight_bits + 2 x 2**-act_bits bounds
        each with a margin."""
        p = self.params
        return min(0.99, 4 * 2.0**-p.weight_bits + 2 * 2.0**-p.act_bits)

    def apply(self, tensors: dict[str, torch.Tensor], x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        qx, sx = quantize_rows(x.reshape(-1, shape[-1]), self.params.act_bits)
        if self.params.kernel == "triton":
            from .kernel import w6a8_gemm

            out = w6a8_gemm(qx, sx, tensors["qweight"], tensors["scale"], bias)
        else:
            out = int_gemm(qx, sx, tensors["qweight"], tensors["scale"], bias)
        return out.to(x.dtype).reshape(*shape[:-1], -1)
