"""The fused dynamic top-k Triton kernel against its reference, under TRITON_INTERPRET=1."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from vllm_graft.plugins.moe.dynamic_topk.kernel import dynamic_topk_triton  # noqa: E402
from vllm_graft.plugins.moe.dynamic_topk.reference import dynamic_topk  # noqa: E402

pytestmark = pytest.mark.kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T, E, k", [(1, 8, 2), (37, 8, 2), (19, 6, 3), (64, 16, 4)])
@pytest.mark.parametrize("criterion, threshold", [("mass", 0.8), ("mass", 0.55), ("entropy", 0.6)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_kernel_matches_reference(dtype, T, E, k, criterion, threshold, renormalize):
    g = torch.Generator().manual_seed(T * 131 + E * 7 + k)
    x = (torch.randn(T, E, generator=g) * 2.5).to(dtype)
    w, ids, kept = dynamic_topk_triton(x, k, renormalize, threshold=threshold, criterion=criterion)
    w_ref, ids_ref, kept_ref = dynamic_topk(x, k, renormalize, threshold=threshold, criterion=criterion)
    err = (w - w_ref).abs().max().item()
    print(f"dynamic_topk {dtype} T={T} E={E} k={k} {criterion}@{threshold} renorm={renormalize}: "
          f"max |w - ref| = {err:.2e}, kept mean {kept_ref.float().mean():.2f}")
    assert torch.equal(kept.long(), kept_ref)
    assert torch.equal(ids.long(), ids_ref)
    assert err < 1e-6


def test_kernel_min_k_strided_input_and_empty():
    x = torch.randn(12, 16)[:, :8]  # row stride 16
    w, ids, kept = dynamic_topk_triton(x, 3, True, threshold=0.3, min_k=2)
    w_ref, ids_ref, kept_ref = dynamic_topk(x, 3, True, threshold=0.3, min_k=2)
    assert torch.equal(kept.long(), kept_ref) and (kept >= 2).all()
    assert torch.equal(ids.long(), ids_ref) and torch.allclose(w, w_ref, atol=1e-6)
    w, ids, kept = dynamic_topk_triton(torch.empty(0, 8), 2, True, threshold=0.5)
    assert w.shape == (0, 2)
    with pytest.raises(TypeError, match="fp32/fp16"):
        dynamic_topk_triton(torch.randn(2, 8, dtype=torch.bfloat16), 2, True, threshold=0.5)
