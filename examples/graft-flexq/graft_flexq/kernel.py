"""Triton kernel of `flexq` (`kernel: triton`): the integer GEMM with its rescale epilogue.

``out[m, n] = (sum_k qx[m, k] * qw[n, k]) * sx[m] * sw[n] + bias[n]``, tiles of
``BLOCK_M x BLOCK_N`` outputs, looping over K in ``BLOCK_K`` steps. The int8 operands are
widened to float32 for ``tl.dot`` with ``input_precision="ieee"`` (no TF32 rounding), which
is exact for integer products while the sum stays below 2**24 (|qx| <= 127, |qw| <= 31:
K up to ~4000). On a GPU an int8 ``tl.dot`` (int32 accumulate) would be the fast path;
without a GPU here it is left for when one is lent.

On a machine without a GPU it runs under TRITON_INTERPRET=1 (the conformance kit sets it).
"""
from __future__ import annotations

import torch


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def w6a8_gemm_kernel(qx_ptr, qw_ptr, sx_ptr, sw_ptr, bias_ptr, out_ptr, M, N, K,
                         stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
                         HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            a = tl.load(qx_ptr + rm[:, None] * stride_xm + kk[None, :] * stride_xk,
                        mask=(rm[:, None] < M) & (kk[None, :] < K), other=0).to(tl.float32)
            b = tl.load(qw_ptr + rn[None, :] * stride_wn + kk[:, None] * stride_wk,
                        mask=(rn[None, :] < N) & (kk[:, None] < K), other=0).to(tl.float32)
            acc += tl.dot(a, b, input_precision="ieee")
        sx = tl.load(sx_ptr + rm, mask=rm < M, other=0.0)
        sw = tl.load(sw_ptr + rn, mask=rn < N, other=0.0)
        out = acc * sx[:, None] * sw[None, :]
        if HAS_BIAS:
            out += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :] * stride_on, out,
                 mask=(rm[:, None] < M) & (rn[None, :] < N))

    return w6a8_gemm_kernel


_KERNEL = None


def w6a8_gemm(qx: torch.Tensor, sx: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
              bias: torch.Tensor | None, block_m: int = 16, block_n: int = 32,
              block_k: int = 32) -> torch.Tensor:
    """The launcher: same inputs and float32 result as ``reference.int_gemm``."""
    import triton

    global _KERNEL
    if _KERNEL is None:
        _KERNEL = _kernel()
    m, k = qx.shape
    n = qweight.shape[0]
    out = torch.empty(m, n, dtype=torch.float32, device=qx.device)
    b = bias.float().contiguous() if bias is not None else out  # any pointer when unused
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _KERNEL[grid](qx, qweight, sx.float().contiguous(), scale.float().contiguous(), b, out, m, n, k,
                  qx.stride(0), qx.stride(1), qweight.stride(0), qweight.stride(1),
                  out.stride(0), out.stride(1), HAS_BIAS=bias is not None,
                  BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out
