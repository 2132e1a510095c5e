"""SqueezeLLM's CPU path: each row's LUT (at most 16 fp16 values) held in one vector register
and looked up by 16 indices at a time (AVX-512 ``vpermps``; a scalar loop on CPUs without
AVX-512). Decode-sized calls (at most 8 token rows) multiply the looked-up weights straight
into the rows' accumulators (:func:`fused_linear`: the weight is never written out, 1 byte
read per weight); larger calls write the dense fp32 weight (:func:`dequantize_rows`) and the
matmul reads it.

The torch path (``lut.gather(1, indices.long())``) widens every index to int64 and gathers
element by element: ~1.3 ms for a 1536x576 weight against 0.2 ms for the fp32 matmul itself.
Here a row costs one pass over its bytes. The dense weight holds the LUT's values converted
from fp16 to fp32 exactly, so a layer computed from it is bit-identical to the torch path; the
fused path sums in its own order and agrees to fp32 rounding
(``tests/unit/test_quant_squeezellm_cpu.py``). Built on first use (see
``quant._shared.cpu_extension``); :func:`dequantize_rows` returns ``None`` with the reason
where it cannot be.
"""

from __future__ import annotations

import torch

from .._shared import cpu_extension

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstdint>

// One row's LUT widened to fp32, padded to 16 entries (indices are below 2**bits <= 16).
static inline void row_table(const at::Half* lut, int64_t k, float* t) {
  for (int64_t j = 0; j < 16; ++j) t[j] = j < k ? static_cast<float>(lut[j]) : 0.0f;
}

static void rows_scalar(const uint8_t* idx, const at::Half* lut, float* w, int64_t o0, int64_t o1,
                        int64_t in, int64_t k) {
  float t[16];
  for (int64_t o = o0; o < o1; ++o) {
    row_table(lut + o * k, k, t);
    const uint8_t* ir = idx + o * in;
    float* wr = w + o * in;
    for (int64_t i = 0; i < in; ++i) wr[i] = t[ir[i] & 15];
  }
}

__attribute__((target("avx512f")))
static void rows_avx512(const uint8_t* idx, const at::Half* lut, float* w, int64_t o0, int64_t o1,
                        int64_t in, int64_t k) {
  float t[16];
  for (int64_t o = o0; o < o1; ++o) {
    row_table(lut + o * k, k, t);
    const __m512 table = _mm512_loadu_ps(t);
    const uint8_t* ir = idx + o * in;
    float* wr = w + o * in;
    int64_t i = 0;
    for (; i + 16 <= in; i += 16) {
      const __m512i ix = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ir + i)));
      _mm512_storeu_ps(wr + i, _mm512_permutexvar_ps(ix, table));  // uses each index's low 4 bits
    }
    for (; i < in; ++i) wr[i] = t[ir[i] & 15];
  }
}

// y = x @ W.T without W: per output row, 16 weights at a time from the LUT register, multiplied
// into M <= 8 token rows' accumulators (x fp32 [M, in]). AVX-512 only (the caller checks
// squeezellm_fused_ok()).
template <int M>
__attribute__((target("avx512f")))
static void fused_rows(const uint8_t* idx, const at::Half* lut, const float* x, float* y, int64_t o0,
                       int64_t o1, int64_t in, int64_t k, int64_t out, const int64_t* rowptr,
                       const int64_t* cols, const at::Half* vals) {
  float t[16];
  for (int64_t o = o0; o < o1; ++o) {
    row_table(lut + o * k, k, t);
    const __m512 table = _mm512_loadu_ps(t);
    const uint8_t* ir = idx + o * in;
    __m512 acc[M];
    for (int r = 0; r < M; ++r) acc[r] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= in; i += 16) {
      const __m512i ix = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ir + i)));
      const __m512 wv = _mm512_permutexvar_ps(ix, table);
      for (int r = 0; r < M; ++r) acc[r] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + r * in + i), acc[r]);
    }
    for (int r = 0; r < M; ++r) {
      float sum = _mm512_reduce_add_ps(acc[r]);
      for (int64_t j = i; j < in; ++j) sum += t[ir[j] & 15] * x[r * in + j];
      for (int64_t j = rowptr[o]; j < rowptr[o + 1]; ++j)  // the sparse part, in its stored order
        sum += x[r * in + cols[j]] * static_cast<float>(vals[j]);
      y[r * out + o] = sum;
    }
  }
}

bool squeezellm_fused_ok() { return __builtin_cpu_supports("avx512f"); }

torch::Tensor squeezellm_linear(torch::Tensor x, torch::Tensor indices, torch::Tensor lut,
                                torch::Tensor rowptr, torch::Tensor cols, torch::Tensor vals) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() &&
              x.size(0) >= 1 && x.size(0) <= 8 && x.size(1) == indices.size(1),
              "squeezellm: x fp32 [1 <= m <= 8, in] expected");
  TORCH_CHECK(indices.scalar_type() == torch::kUInt8 && lut.scalar_type() == torch::kHalf &&
              indices.size(0) == lut.size(0) && lut.size(1) <= 16 && indices.is_contiguous() &&
              lut.is_contiguous(), "squeezellm: uint8 indices and an fp16 LUT of at most 16 entries expected");
  TORCH_CHECK(rowptr.scalar_type() == torch::kInt64 && cols.scalar_type() == torch::kInt64 &&
              vals.scalar_type() == torch::kHalf && rowptr.numel() == indices.size(0) + 1 &&
              cols.numel() == vals.numel() && rowptr.is_contiguous() && cols.is_contiguous() &&
              vals.is_contiguous(), "squeezellm: the sparse part as CSR (int64 rowptr, cols; fp16 vals)");
  TORCH_CHECK(squeezellm_fused_ok(), "squeezellm: the fused path needs AVX-512");
  const int64_t m = x.size(0), in = x.size(1), out = indices.size(0), k = lut.size(1);
  auto y = torch::empty({m, out}, torch::dtype(torch::kFloat32));
  const uint8_t* ip = indices.data_ptr<uint8_t>();
  const at::Half* lp = lut.data_ptr<at::Half>();
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t* rp = rowptr.data_ptr<int64_t>();
  const int64_t* cp = cols.data_ptr<int64_t>();
  const at::Half* vp = vals.data_ptr<at::Half>();
  TORCH_CHECK(rp[0] == 0 && rp[indices.size(0)] == cols.numel(), "squeezellm: rowptr does not span cols");
  at::parallel_for(0, out, 64, [&](int64_t o0, int64_t o1) {
    switch (m) {  // the row count fixed at compile time: the accumulators live in registers
      case 1: fused_rows<1>(ip, lp, xp, yp, o0, o1, in, k, out, rp, cp, vp); break;
      case 2: fused_rows<2>(ip, lp, xp, yp, o0, o1, in, k, out, rp, cp, vp); break;
      case 3: fused_rows<3>(ip, lp, xp, yp, o0, o1, in, k, out, rp, cp, vp); break;
      case 4: fused_rows<4>(ip, lp, xp, yp, o0, o1, in, k, out, rp, cp, vp); break;
      case 5: fused_rows<5>(ip, lp, xp, yp, o0, o1, in, k, out, rp, cp, vp); break;
      case 6: fused_rows<6>(ip, lp, xp, yp, o0, o1, in, k, out, rp, cp, vp); break;
      case 7: fused_rows<7>(ip, lp, xp, yp, o0, o1, in, k, out, rp, cp, vp); break;
      default: fused_rows<8>(ip, lp, xp, yp, o0, o1, in, k, out, rp, cp, vp); break;
    }
  });
  return y;
}

// indices: uint8 [out, in]; lut: fp16 [out, k], k <= 16; w: fp32 [out, in], written and returned.
torch::Tensor squeezellm_dequantize(torch::Tensor indices, torch::Tensor lut, torch::Tensor w) {
  TORCH_CHECK(indices.dim() == 2 && lut.dim() == 2 && indices.size(0) == lut.size(0),
              "squeezellm: indices [out, in] and lut [out, k] expected");
  TORCH_CHECK(indices.scalar_type() == torch::kUInt8 && lut.scalar_type() == torch::kHalf &&
              lut.size(1) <= 16 && indices.is_contiguous() && lut.is_contiguous(),
              "squeezellm: contiguous uint8 indices and an fp16 LUT of at most 16 entries expected");
  const int64_t out = indices.size(0), in = indices.size(1), k = lut.size(1);
  TORCH_CHECK(w.scalar_type() == torch::kFloat32 && w.is_contiguous() && w.dim() == 2 &&
              w.size(0) == out && w.size(1) == in, "squeezellm: w must be contiguous fp32 [out, in]");
  const uint8_t* ip = indices.data_ptr<uint8_t>();
  const at::Half* lp = lut.data_ptr<at::Half>();
  float* wp = w.data_ptr<float>();
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  at::parallel_for(0, out, 16, [&](int64_t o0, int64_t o1) {
    if (avx512) rows_avx512(ip, lp, wp, o0, o1, in, k);
    else rows_scalar(ip, lp, wp, o0, o1, in, k);
  });
  return w;
}
"""


#: The most token rows the fused path takes (its accumulators stay in registers); larger calls
#: (prefill) dequantise the weight and call the matmul.
FUSED_MAX_ROWS = 8


def _module():
    return cpu_extension(
        "vllm_graft_squeezellm_cpu", _SOURCE, ["squeezellm_dequantize", "squeezellm_linear", "squeezellm_fused_ok"]
    )


def dequantizer():
    """``(function, None)`` once the C++ dequantiser is built, else ``(None, reason)``."""
    module, reason = _module()
    return (module.squeezellm_dequantize if module is not None else None), reason


def fused_linear(x: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """``x @ W.T`` (fp32 ``[m, out]``, the dense and the sparse part) without building ``W``,
    for ``m <= FUSED_MAX_ROWS`` token rows on a CPU with AVX-512; None where it does not apply
    (the caller dequantises). ``tensors``: the layer's (``indices``, ``lut``, the sparse part
    as CSR ``sparse_rowptr``/``sparse_cols``/``sparse_vals``). Sums in another order than the
    matmul: equal to it to fp32 rounding, not bit for bit."""
    indices, lut = tensors["indices"], tensors["lut"]
    if x.dim() != 2 or not 1 <= x.shape[0] <= FUSED_MAX_ROWS or x.device.type != "cpu" or lut.dtype != torch.float16:
        return None
    module, _ = _module()
    if module is None or not module.squeezellm_fused_ok():
        return None
    return module.squeezellm_linear(
        x.float().contiguous(), indices, lut, tensors["sparse_rowptr"], tensors["sparse_cols"], tensors["sparse_vals"]
    )


def dequantize_rows(indices: torch.Tensor, lut: torch.Tensor, out: torch.Tensor | None = None):
    """``(weight, None)``: the dense weight ``[out, in]`` (fp32) through the C++ dequantiser,
    written into ``out`` when given (e.g. ``quant._shared.scratch``); ``(None, reason)`` where
    it cannot be built or does not apply (not on the CPU, not an fp16 LUT)."""
    if indices.device.type != "cpu" or lut.dtype != torch.float16:
        return None, f"the C++ path takes CPU tensors and an fp16 LUT ({indices.device}, {lut.dtype})"
    fn, reason = dequantizer()
    if fn is None:
        return None, reason
    if out is None:
        out = torch.empty(indices.shape, dtype=torch.float32, device=indices.device)
    return fn(indices, lut, out), None
