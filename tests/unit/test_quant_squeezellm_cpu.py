"""SqueezeLLM's C++ CPU path (plugins/quant/squeezellm/cpu.py) against its torch path: the
dense weight it writes is the torch gather's bit for bit; decode-sized calls (the fused
LUT x activation loop, sparse part included) agree with the torch path to fp32 rounding;
larger calls are bit-identical; a path that cannot be built says so once and the torch one runs."""
from __future__ import annotations

import pytest
import torch

from vllm_graft.plugins.quant.squeezellm import SqueezeLLMParams, cpu
from vllm_graft.plugins.quant.squeezellm import reference as R

from .builds import require_built


def _built() -> None:
    require_built(cpu.dequantizer(), "the path")


def _layer(bits: int, out: int, inp: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * 0.05
    fast = R.SqueezeLLM(SqueezeLLMParams(bits=bits, kmeans_iters=3, outliers=0.02))
    torch_path = R.SqueezeLLM(SqueezeLLMParams(bits=bits, kmeans_iters=3, outliers=0.02, cpu_dequant="torch"))
    q = fast.quantize(w)
    return fast, torch_path, fast.load({k: [v] for k, v in q.items()}, [out]), g


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("shape", [(37, 72), (64, 576), (5, 16)])
def test_dense_weight_is_the_torch_gather_bit_for_bit(bits, shape):
    _built()
    _, _, t, _ = _layer(bits, *shape)
    w, reason = cpu.dequantize_rows(t["indices"], t["lut"])
    assert reason is None
    assert torch.equal(w, t["lut"].gather(1, t["indices"].long()).float())


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_sized_calls_agree_with_the_torch_path(bits, rows, dtype):
    _built()
    fast, slow, t, g = _layer(bits, 48, 72, seed=rows)
    assert t["sparse_rows"].numel() > 0  # the sparse part is exercised
    x = torch.randn(rows, 72, generator=g).to(dtype)
    bias = torch.randn(48, generator=g).to(dtype)
    a, b = fast.apply(t, x, bias), slow.apply(t, x, bias)
    assert a.dtype == b.dtype == dtype and a.shape == b.shape == (rows, 48)
    ref = b.float().abs().max().item()
    tol = (2e-6 if dtype == torch.float32 else 2e-3) * max(1.0, ref)
    assert (a.float() - b.float()).abs().max().item() <= tol
    module, _ = cpu._module()
    if not module.squeezellm_fused_ok():  # the fused loop is AVX-512 only
        pytest.skip("no AVX-512 on this CPU: the fused path does not apply (the dequantise path was compared)")
    assert cpu.fused_linear(x.float(), t) is not None  # it was the fused path that ran


def test_larger_calls_and_batched_shapes_are_bit_identical():
    _built()
    fast, slow, t, g = _layer(4, 48, 72)
    for shape in ((9, 72), (64, 72), (2, 5, 72)):  # above the fused rows; 10 rows via a 3-D x
        x = torch.randn(*shape, generator=g)
        assert torch.equal(fast.apply(t, x, None), slow.apply(t, x, None))
    x = torch.randn(2, 3, 72, generator=g)  # 6 rows, fused, then reshaped back
    a, b = fast.apply(t, x, None), slow.apply(t, x, None)
    assert a.shape == (2, 3, 48) and torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_path_that_cannot_be_built_says_so_once(monkeypatch, caplog):
    fast, slow, t, g = _layer(4, 16, 32)
    monkeypatch.setattr(cpu, "_module", lambda: (None, "RuntimeError: no compiler (test)"))
    from vllm_graft.plugins.quant import _shared

    monkeypatch.setattr(_shared, "_said", set())
    x = torch.randn(20, 32, generator=g)
    with caplog.at_level("WARNING", logger="vllm_graft"):
        assert torch.equal(fast.apply(t, x, None), slow.apply(t, x, None))
        assert torch.equal(fast.apply(t, x[:2], None), slow.apply(t, x[:2], None))
    said = [r.getMessage() for r in caplog.records if "C++ CPU dequantisation" in r.getMessage()]
    assert len(said) == 1 and "no compiler (test)" in said[0] and "cpu_dequant: torch" in said[0]


def test_cpu_dequant_is_not_a_checkpoint_parameter():
    assert "cpu_dequant" not in R.SqueezeLLM(SqueezeLLMParams(cpu_dequant="torch")).checkpoint_params()
    with pytest.raises(Exception, match="cpu_dequant"):
        SqueezeLLMParams(cpu_dequant="simd")


def test_larger_calls_reuse_one_buffer_for_the_dense_weight():
    _built()
    fast, _, t, g = _layer(4, 48, 72)
    a = fast.dense_from_indices(t, reuse=True)
    b = fast.dense_from_indices(t, reuse=True)
    c = fast.dense_from_indices(t)
    assert a.data_ptr() == b.data_ptr() != c.data_ptr()
    assert torch.equal(c, t["lut"].gather(1, t["indices"].long()).float()) and torch.equal(a, c)
