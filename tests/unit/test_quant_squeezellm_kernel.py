"""SqueezeLLM's Triton LUT GEMM (prefill) and GEMV (decode) against the dequantised matmul,
under the Triton interpreter (fp32 and fp16, small shapes)."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from vllm_graft.plugins.quant.squeezellm.reference import dequantize, pack_bitplanes  # noqa: E402

pytestmark = pytest.mark.kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("M", [1, 3, 20])  # GEMV, GEMV, GEMM (a partial row tile)
def test_lut_matmul_matches_dequantised_matmul(dtype, bits, M):
    from vllm_graft.plugins.quant.squeezellm.kernel import GEMV_MAX_ROWS, lut_matmul

    g = torch.Generator().manual_seed(bits * 100 + M)
    N, K = 40, 48  # partial N tile; K not a multiple of the 32-wide K tile
    idx = torch.randint(0, 1 << bits, (N, K), generator=g)
    codes = pack_bitplanes(idx, bits)
    lut = torch.randn(N, 1 << bits, generator=g).to(dtype)
    x = torch.randn(M, K, generator=g).to(dtype)
    got = lut_matmul(x, codes, lut, bits)
    ref = x.float() @ dequantize(codes, lut, bits).float().T
    err = (got.float() - ref).abs().max().item()
    path = "GEMV" if M <= GEMV_MAX_ROWS else "GEMM"
    print(f"LUT {path} bits={bits} M={M} {dtype}: max abs error {err:.3g}")
    assert got.dtype == dtype and got.shape == (M, N)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert err <= tol * max(1.0, ref.abs().max().item())


def test_plugin_triton_backend_equals_reference_backend():
    from vllm_graft.plugins.quant.squeezellm import SqueezeLLMParams
    from vllm_graft.plugins.quant.squeezellm.reference import SqueezeLLM

    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 32, generator=g)
    ref_m = SqueezeLLM(SqueezeLLMParams(bits=4, kmeans_iters=3))
    tri_m = SqueezeLLM(SqueezeLLMParams(bits=4, kmeans_iters=3, kernel="triton"))
    t = ref_m.load({k: [v] for k, v in ref_m.quantize(w).items()}, [24])
    x = torch.randn(2, 5, 32, generator=g)
    a, b = ref_m.apply(t, x, torch.ones(24)), tri_m.apply(t, x, torch.ones(24))
    err = (a - b).abs().max().item()
    print(f"squeezellm triton vs reference backend (with sparse part and bias): max abs error {err:.3g}")
    assert err < 1e-4


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_unpacked_index_path_is_bit_identical_to_unpacking_per_call(bits, dtype):
    from vllm_graft.plugins.quant.squeezellm import SqueezeLLMParams
    from vllm_graft.plugins.quant.squeezellm.reference import SqueezeLLM

    g = torch.Generator().manual_seed(bits)
    w = torch.randn(40, 64, generator=g)
    # the torch gather (the C++ path's own tests: test_quant_squeezellm_cpu.py)
    fast = SqueezeLLM(SqueezeLLMParams(bits=bits, kmeans_iters=3, cpu_dequant="torch"))
    slow = SqueezeLLM(SqueezeLLMParams(bits=bits, kmeans_iters=3, cpu_weights="packed"))
    q = fast.quantize(w)
    t_fast, t_slow = fast.load({k: [v] for k, v in q.items()}, [40]), slow.load({k: [v] for k, v in q.items()}, [40])
    assert t_fast["indices"].dtype == torch.uint8 and "indices" not in t_slow
    x = torch.randn(3, 64, generator=g).to(dtype)
    assert torch.equal(fast.apply(t_fast, x, None), slow.apply(t_slow, x, None))
    assert "cpu_weights" not in fast.checkpoint_params()
