"""w4a8 (QServe progressive): the two-level quantiser's invariants, and the Triton GEMM
(int4 -> int8 dequantisation in the inner loop, int32 accumulation) against its fp32
emulation under the Triton interpreter."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from vllm_graft.plugins.quant.w4a8 import W4A8Params  # noqa: E402
from vllm_graft.plugins.quant.w4a8.reference import (  # noqa: E402
    W4A8,
    emulate,
    int8_matmul,
    int8_weight,
    quantize,
)


def test_progressive_quantisation_stays_in_int8_and_is_close():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 200, generator=g) * 0.05  # 200 columns: a partial last group of 72
    t = quantize(w, 128)
    assert t["qweight"].shape == (64, 100) and t["group_zero"].shape == (64, 2)
    assert int(t["group_zero"].max()) <= 15 and int(t["group_mult"].min()) >= 1
    w8 = int8_weight(t, 128)
    assert int(w8.min()) >= -128 and int(w8.max()) <= 127
    deq = w8.float() * t["channel_step"].float()
    rel = ((deq - w).norm() / w.norm()).item()
    print(f"w4a8 weight relative error (random gaussian, group 128): {rel:.4f}")
    assert rel < 0.15
    x = torch.randn(5, 200, generator=g)
    y = emulate(x, t, 128)
    rel_y = ((y - x @ w.T).norm() / (x @ w.T).norm()).item()
    print(f"w4a8 output relative error: {rel_y:.4f}")
    assert rel_y < 0.15


def test_params_and_stored_tensors():
    m = W4A8(W4A8Params(group_size=64))
    specs = m.stored_tensors(10, 200)
    got = m.quantize(torch.randn(10, 200))
    assert {k: (tuple(v.shape), str(v.dtype)[6:]) for k, v in got.items()} == \
        {k: (s.shape, s.dtype) for k, s in specs.items()}
    assert "kernel" not in m.checkpoint_params() and "cpu_weights" not in m.checkpoint_params()
    m.verify(got)
    with pytest.raises(ValueError, match="^group_zero:"):
        m.verify(dict(got, group_zero=got["group_zero"] + 16))
    with pytest.raises(Exception, match="group_size"):
        W4A8Params(group_size=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M,N,K,gs", [(1, 40, 48, 16), (20, 24, 72, 32), (7, 96, 200, 128), (3, 33, 4096, 128)])
def test_the_unpacked_int8_path_is_bit_identical_to_the_emulation(dtype, M, N, K, gs):
    g = torch.Generator().manual_seed(M * N)
    w = torch.randn(N, K, generator=g) * 0.1
    x = (torch.randn(M, K, generator=g) * 3).to(dtype)
    fast, slow = W4A8(W4A8Params(group_size=gs)), W4A8(W4A8Params(group_size=gs, cpu_weights="packed"))
    t_fast = fast.load({k: [v] for k, v in fast.quantize(w).items()}, [N])
    t_slow = slow.load({k: [v] for k, v in slow.quantize(w).items()}, [N])
    assert t_fast["weight_int8"].dtype == torch.int8 and "weight_int8" not in t_slow
    assert torch.equal(int8_matmul(x, t_fast), emulate(x, t_slow, gs))
    assert torch.equal(fast.apply(t_fast, x, None), slow.apply(t_slow, x, None))
    # the Triton path keeps the 4-bit codes only
    assert "weight_int8" not in W4A8(W4A8Params(group_size=gs, kernel="triton")).load(
        {k: [v] for k, v in fast.quantize(w).items()}, [N])


@pytest.mark.kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M,N,K,gs", [(1, 40, 48, 16), (20, 24, 72, 32)])
def test_w4a8_gemm_matches_fp32_emulation(dtype, M, N, K, gs):
    from vllm_graft.plugins.quant.w4a8.kernel import w4a8_matmul

    g = torch.Generator().manual_seed(M + N)
    w = torch.randn(N, K, generator=g) * 0.1
    t = quantize(w, gs)
    x = torch.randn(M, K, generator=g).to(dtype)
    got = w4a8_matmul(x, t, gs)
    ref = emulate(x, t, gs)
    err = (got - ref).abs().max().item()
    print(f"W4A8 GEMM M={M} N={N} K={K} group={gs} x {dtype}: max abs error vs fp32 emulation {err:.3g}")
    assert err <= 1e-5 * max(1.0, ref.abs().max().item())


@pytest.mark.kernel
def test_quant_kernel_bench_runs_at_tiny_shapes():
    """The GPU kernel benchmark's code path, on CPU under the interpreter (times meaningless)."""
    from vllm_graft.tools.quant.kernel_bench import TINY, run

    rows = run([1, 20], TINY, "cpu", iters=1, peak_gbs=1.0)
    assert [r["kernel"] for r in rows[:4]] == ["fp16 matmul", "squeezellm LUT 4-bit",
                                                "squeezellm LUT 3-bit", "w4a8 GEMM"]
    assert len(rows) == 8 and all(r["us"] > 0 and r["GB/s"] >= 0 for r in rows)
