"""SqueezeLLM's Triton kernels: the dense part ``x @ LUT[codes].T`` without materialising
the dequantised weight. The inner loop unpacks ``BITS`` bit planes of a ``[BN, BK]`` tile of
indices and gathers the row's LUT entries, then multiplies:

* ``_lut_gemm`` (prefill, many rows of ``x``): ``[BM, BK] x [BK, BN]`` tiles with ``tl.dot``;
* ``_lut_gemv`` (decode, a few rows): one row of ``x`` per program, a multiply-and-sum.

The sparse part is added by the caller (``reference.add_sparse``). Accumulation is fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._kernel import load_rows, output_tile, store_tile

#: Rows of x up to which the GEMV kernel is used.
GEMV_MAX_ROWS = 8


@triton.jit
def _unpack_tile(codes_ptr, lut_ptr, rn, rk, N, K, stride_cn, BITS: tl.constexpr):
    """LUT values ``[BN, BK]`` (fp32) of output rows ``rn`` and input columns ``rk``."""
    K8 = K // 8
    ok = (rn < N)[:, None] & (rk < K)[None, :]
    idx = tl.zeros((rn.shape[0], rk.shape[0]), dtype=tl.int32)
    for b in tl.static_range(BITS):
        byte = tl.load(codes_ptr + rn[:, None] * stride_cn + b * K8 + (rk // 8)[None, :], mask=ok, other=0)
        idx = idx | (((byte.to(tl.int32) >> (rk % 8)[None, :]) & 1) << b)
    w = tl.load(lut_ptr + rn[:, None] * (1 << BITS) + idx, mask=ok, other=0.0)
    return w.to(tl.float32)


@triton.jit
def _lut_gemm(
    x_ptr,
    codes_ptr,
    lut_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_cn,
    stride_ym,
    BITS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    rm, rn = output_tile(BM, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        x = load_rows(x_ptr, rm, rk, M, K, stride_xm).to(tl.float32)
        w = _unpack_tile(codes_ptr, lut_ptr, rn, rk, N, K, stride_cn, BITS)
        acc += tl.dot(x, tl.trans(w))
    store_tile(y_ptr, acc, rm, rn, M, N, stride_ym)


@triton.jit
def _lut_gemv(
    x_ptr,
    codes_ptr,
    lut_ptr,
    y_ptr,
    N,
    K,
    stride_xm,
    stride_cn,
    stride_ym,
    BITS: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros((BN,), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + m * stride_xm + rk, mask=rk < K, other=0.0).to(tl.float32)
        w = _unpack_tile(codes_ptr, lut_ptr, rn, rk, N, K, stride_cn, BITS)
        acc += tl.sum(w * x[None, :], axis=1)
    tl.store(y_ptr + m * stride_ym + rn, acc.to(y_ptr.dtype.element_ty), mask=rn < N)


def lut_matmul(
    x: torch.Tensor,
    codes: torch.Tensor,
    lut: torch.Tensor,
    bits: int,
    *,
    block_n: int = 32,
    block_k: int = 32,
    block_m: int = 16,
) -> torch.Tensor:
    """``x @ LUT[codes].T`` (``x`` ``[..., K]``; ``codes`` uint8 ``[N, bits*K/8]``; ``lut``
    ``[N, 2**bits]``) in ``x``'s dtype: GEMV for up to ``GEMV_MAX_ROWS`` rows, else GEMM."""
    K = x.shape[-1]
    N = codes.shape[0]
    if codes.shape[1] * 8 != bits * K or K % 8:
        raise ValueError(f"codes {tuple(codes.shape)} do not hold {bits}-bit indices for K={K}")
    x2 = x.reshape(-1, K).contiguous()
    codes, lut = codes.contiguous(), lut.contiguous()
    M = x2.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M <= GEMV_MAX_ROWS:
        _lut_gemv[(M, triton.cdiv(N, block_n))](
            x2, codes, lut, y, N, K, x2.stride(0), codes.stride(0), y.stride(0), BITS=bits, BN=block_n, BK=block_k
        )
    else:
        grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
        _lut_gemm[grid](
            x2,
            codes,
            lut,
            y,
            M,
            N,
            K,
            x2.stride(0),
            codes.stride(0),
            y.stride(0),
            BITS=bits,
            BM=block_m,
            BN=block_n,
            BK=block_k,
        )
    return y.reshape(*x.shape[:-1], N)
