"""Token Recycling's Triton kernel (top-k update of the successor matrix from logits) against
its PyTorch reference, under the Triton interpreter (CPU)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import importlib  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from vllm_graft.plugins.speculative.token_recycling.reference import topk_update_reference  # noqa: E402

pytestmark = pytest.mark.kernel


def kernel():
    return importlib.import_module("vllm_graft.plugins.speculative.token_recycling.kernel")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows, vocab, k, block", [(5, 50, 4, 16), (3, 37, 3, 64), (6, 128, 8, 32)])
def test_kernel_matches_reference(dtype, rows, vocab, k, block):
    g = torch.Generator().manual_seed(rows * vocab + k)
    logits = torch.randn(rows, vocab, generator=g).to(dtype)
    logits[0, :5] = logits[0, 5]  # ties: lower token id first
    logits[1 % rows, -3:] = -float("inf")  # padded vocabulary entries
    tokens = torch.randint(0, 20, (rows,), generator=g)
    tokens[-1] = tokens[0]  # a repeated token: the last row wins
    ref = topk_update_reference(logits, tokens, torch.full((20, k), -1, dtype=torch.int64))
    got = kernel().recycle_update(logits, tokens, torch.full((20, k), -1, dtype=torch.int64),
                                  block_v=block)
    mismatched = int((got != ref).sum())
    print(f"{dtype} R={rows} V={vocab} k={k}: {mismatched} cells differ (max error "
          f"{int((got - ref).abs().max())})")
    assert torch.equal(got, ref)
    # and the reference is what it says: the top-k by value of the last row of each token
    for t in tokens.unique().tolist():
        r = int(np.nonzero((tokens == t).numpy())[0][-1])
        vals = logits[r].float()
        assert torch.equal(vals[ref[t]], torch.sort(vals, descending=True).values[:k])
    untouched = sorted(set(range(20)) - set(tokens.tolist()))
    assert (got[untouched] == -1).all()


def test_launcher_refuses_bad_shapes():
    k = kernel()
    with pytest.raises(ValueError, match=r"logits \[R, V\]"):
        k.recycle_update(torch.zeros(3, 8), torch.zeros(2, dtype=torch.long),
                         torch.zeros(4, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="exceeds the vocabulary"):
        k.recycle_update(torch.zeros(1, 2), torch.zeros(1, dtype=torch.long),
                         torch.zeros(4, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="token ids"):
        k.recycle_update(torch.zeros(1, 8), torch.tensor([9]), torch.zeros(4, 2, dtype=torch.int64))


def test_plugin_update_from_logits_cpu_path_equals_observe_topk():
    from vllm_graft.hooks import get_registry
    from vllm_graft.hooks.registry import Kind

    entry = get_registry().get(Kind.SPECULATIVE, "token-recycling")
    make = lambda: entry.registration.load()(entry.registration.params.model_validate({"k": 3}))  # noqa: E731
    a, b = make(), make()
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(0))
    tokens = [3, 7, 3, 1]
    a.update_from_logits(tokens, logits)
    for r, t in enumerate(tokens):
        b.observe_topk("x", [t], torch.topk(logits[r], 3).indices.numpy()[None])
    assert np.array_equal(a.matrix.m, b.matrix.m)
