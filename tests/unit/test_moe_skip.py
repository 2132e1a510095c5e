"""``integration/adapters/moe/skip.py: run_kept`` without vLLM: the experts callable sees only
the kept (token, expert) pairs, in one call, and the tokens' sums are those of the full routing."""
from __future__ import annotations

import torch

from vllm_graft.integration.adapters.moe.skip import run_kept

E, H = 6, 16


def _experts(seed=0):
    g = torch.Generator().manual_seed(seed)
    mats = torch.randn(E, H, H, generator=g)
    calls = []

    def experts(x, w, ids):
        assert x.shape[0] == w.shape[0] == ids.shape[0] and w.shape[1] == ids.shape[1] == 1
        assert ids.dtype == torch.int32 and w.dtype == torch.float32
        calls.append((x.clone(), w.clone(), ids.clone()))
        y = torch.einsum("nh,nhk->nk", x.float(), mats[ids[:, 0].long()])
        return (y * w).to(x.dtype)

    return mats, calls, experts


def _full(x, w, ids, mats):
    y = torch.einsum("th,tjhk->tjk", x.float(), mats[ids.long()])
    return (y * w.unsqueeze(-1)).sum(1)


def test_only_kept_pairs_reach_the_experts_in_one_call():
    mats, calls, experts = _experts()
    torch.manual_seed(0)
    T, k = 10, 3
    x = torch.randn(T, H)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).int()
    w = torch.rand(T, k)
    w[0, 0] = 0  # a pruned first slot
    w[1, 1:] = 0  # two pruned
    w[2] = 0  # nothing kept
    out, kept = run_kept(x, w, ids, experts)
    keep = w != 0
    assert kept == int(keep.sum()) == T * k - 6
    assert len(calls) == 1
    xr, wr, ir = calls[0]
    tok, slot = keep.nonzero(as_tuple=True)
    sent = sorted((bytes(r.numpy()), int(i)) for r, i in zip(xr, ir[:, 0]))
    assert sent == sorted((bytes(x[t].numpy()), int(ids[t, s])) for t, s in zip(tok, slot))  # the kept pairs, once each
    # float32: each token's first kept slot weighted by the kernel, later slots unweighted (added
    # with a fused multiply-add); tokens keeping a second slot come first
    firsts = T - 1  # token 2 keeps nothing
    assert torch.equal(wr[firsts:], torch.ones_like(wr[firsts:]))
    assert sorted(wr[:firsts, 0].tolist()) == sorted(w[t, int(keep[t].float().argmax())].item()
                                                     for t in range(T) if keep[t].any())
    assert torch.allclose(out, _full(x, w, ids, mats), rtol=1e-5, atol=1e-5)
    assert torch.equal(out[2], torch.zeros(H))


def test_rows_go_rank_by_rank_tokens_keeping_most_first():
    _, calls, experts = _experts()
    T = 5
    x = torch.randn(T, H)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [1, 0], [3, 2]], dtype=torch.int32)
    w = torch.tensor([[0.0, 1.0], [0.6, 0.4], [1.0, 0.0], [0.7, 0.3], [0.9, 0.0]])
    run_kept(x, w, ids, experts)
    xr, wr, ir = calls[0]
    # tokens 1 and 3 keep two slots: order 1, 3, 0, 2, 4; their first kept slots, then the second ones
    assert ir[:, 0].tolist() == [2, 1, 1, 4, 3, 3, 0]
    assert torch.equal(xr, x[[1, 3, 0, 2, 4, 1, 3]])
    assert torch.equal(wr[:, 0], torch.tensor([0.6, 0.7, 1.0, 1.0, 0.9, 1.0, 1.0]))


def test_nothing_pruned_leaves_the_layer_its_own_routing():
    _, calls, experts = _experts()
    w = torch.rand(4, 2) + 0.1
    assert run_kept(torch.randn(4, H), w, torch.zeros(4, 2, dtype=torch.int32), experts) is None
    assert calls == []


def test_half_precision_rows_are_weighted_in_the_kernel():
    mats, calls, experts = _experts(1)
    torch.manual_seed(1)
    T = 8
    x = torch.randn(T, H).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E)[:2] for _ in range(T)]).int()
    w = torch.rand(T, 2)
    w[::2, 1] = 0
    out, kept = run_kept(x, w, ids, experts)
    assert out.dtype == torch.bfloat16 and kept == T + T // 2
    keep = w != 0
    assert sorted(calls[0][1][:, 0].tolist()) == sorted(w[keep].tolist())  # the kernel weights its rows
    one = ~keep[:, 1]
    # a token with one kept slot: the kernel's own weighted row, unchanged
    rows = experts(x[one], w[one, :1].contiguous(), ids[one, :1].contiguous())
    assert torch.equal(out[one], rows)
    assert torch.allclose(out.float(), _full(x, w, ids, mats), rtol=3e-2, atol=3e-2)


def test_fewer_pruned_slots_than_the_minimum_leave_the_full_routing():
    _, calls, experts = _experts()
    w = torch.rand(6, 2) + 0.1
    w[:3, 1] = 0  # 3 pruned slots
    ids = torch.zeros(6, 2, dtype=torch.int32)
    assert run_kept(torch.randn(6, H), w, ids, experts, min_pruned=4) is None and calls == []
    out, kept = run_kept(torch.randn(6, H), w, ids, experts, min_pruned=3)
    assert kept == 9 and len(calls) == 1
