"""W4A8 Triton GEMM: int8 activations x int4 weights. The inner loop unpacks a ``[BN, BK]``
tile of 4-bit codes, dequantises them to int8 with the group's zero point and integer
multiplier (``(q4 - zero) * mult``, integer only), and accumulates ``int8 x int8`` products
in int32 with ``tl.dot``; the epilogue scales by token step x channel step."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._kernel import load_rows, output_tile, store_tile
from .._shared import quantize_activations


@triton.jit
def _w4a8_gemm(
    x_ptr,
    sx_ptr,
    qw_ptr,
    zero_ptr,
    mult_ptr,
    step_ptr,
    y_ptr,
    M,
    N,
    K,
    G,
    stride_xm,
    stride_qn,
    stride_gn,
    stride_ym,
    GS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    rm, rn = output_tile(BM, BN)
    acc = tl.zeros((BM, BN), dtype=tl.int32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        x = load_rows(x_ptr, rm, rk, M, K, stride_xm)
        ok = (rn < N)[:, None] & (rk < K)[None, :]
        byte = tl.load(qw_ptr + rn[:, None] * stride_qn + (rk // 2)[None, :], mask=ok, other=0).to(tl.int32)
        q4 = (byte >> ((rk % 2) * 4)[None, :]) & 15
        g = rk // GS
        z = tl.load(zero_ptr + rn[:, None] * stride_gn + g[None, :], mask=ok, other=0).to(tl.int32)
        mu = tl.load(mult_ptr + rn[:, None] * stride_gn + g[None, :], mask=ok, other=0).to(tl.int32)
        w8 = tl.minimum(tl.maximum((q4 - z) * mu, -128), 127).to(tl.int8)
        acc += tl.dot(x, tl.trans(w8))
    sx = tl.load(sx_ptr + rm, mask=rm < M, other=0.0)
    step = tl.load(step_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    y = acc.to(tl.float32) * sx[:, None] * step[None, :]
    store_tile(y_ptr, y, rm, rn, M, N, stride_ym)


def w4a8_matmul(
    x: torch.Tensor,
    t: dict[str, torch.Tensor],
    group_size: int,
    *,
    block_m: int = 16,
    block_n: int = 32,
    block_k: int = 32,
) -> torch.Tensor:
    """fp32 ``[..., N]``: ``x`` quantised to int8 per token, times the W4A8 weight ``t``."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    xq, sx = quantize_activations(x2)
    xq, sx = xq.contiguous(), sx.reshape(-1).contiguous()
    qw, zero, mult = t["qweight"].contiguous(), t["group_zero"].contiguous(), t["group_mult"].contiguous()
    step = t["channel_step"].reshape(-1).contiguous()
    M, N, G = x2.shape[0], qw.shape[0], zero.shape[1]
    y = torch.empty((M, N), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _w4a8_gemm[grid](
        xq,
        sx,
        qw,
        zero,
        mult,
        step,
        y,
        M,
        N,
        K,
        G,
        xq.stride(0),
        qw.stride(0),
        zero.stride(0),
        y.stride(0),
        GS=group_size,
        BM=block_m,
        BN=block_n,
        BK=block_k,
    )
    return y.reshape(*x.shape[:-1], N)
