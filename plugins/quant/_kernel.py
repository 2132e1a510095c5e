"""The Triton pieces the quantised GEMM kernels share (SqueezeLLM's LUT GEMM, W4A8): a
program's tile of output rows and columns, the masked load of an activation tile and the
masked store of an output tile (``y [M, N]``, ``x [M, K]``, unit stride along the last axis)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def output_tile(BM: tl.constexpr, BN: tl.constexpr):
    """The rows ``rm [BM]`` and columns ``rn [BN]`` of ``y`` of program ``(pid_m, pid_n)``."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    return pid_m * BM + tl.arange(0, BM), pid_n * BN + tl.arange(0, BN)


@triton.jit
def load_rows(x_ptr, rm, rk, M, K, stride_xm):
    """``x[rm, rk]`` ``[BM, BK]``, 0 outside ``[M, K]``, in ``x``'s dtype."""
    return tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm < M)[:, None] & (rk < K)[None, :], other=0)


@triton.jit
def store_tile(y_ptr, y, rm, rn, M, N, stride_ym):
    """``y [BM, BN]`` into ``y_ptr[rm, rn]`` inside ``[M, N]``, in the output's dtype."""
    tl.store(
        y_ptr + rm[:, None] * stride_ym + rn[None, :],
        y.to(y_ptr.dtype.element_ty),
        mask=(rm < M)[:, None] & (rn < N)[None, :],
    )
