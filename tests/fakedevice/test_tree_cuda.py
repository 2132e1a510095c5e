"""Tree verification on CUDA (issue 33) with vLLM's tensors on the (fake) device: the tree rows
by the Triton kernel (``_tree.kernel``, interpreted here under TRITON_INTERPRET=1, compiled with
GRAFT_REAL_DEVICE=cuda) in the packed cache layout of vLLM's CUDA backends, against a dense
oracle; no host sync in any layer after the first; the accepted nodes' KV moved in the packed
layout; and a whole step (positions, plan, layers, verdict, KV moves) on the device."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.fakedevice import plan_and_layers
from tests.kernels.layouts import CACHES, in_cache
from tests.unit.test_spec_tree_engine import _runner, step_tree, verifier_with
from vllm_graft.hooks import BLOCKED, PACKED, AttentionLayer, PagedBatch
from vllm_graft.integration.adapters.speculative import tree as T

pytest.importorskip("triton")

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 8, 4
LAYERS = 3
PARENTS = [-1, -1, 0, 1, 1, 3]  # six nodes after the root


def _case(seed=0):
    """Two sequences: a prefill chunk of 3 tokens after 2 cached (row 0), and a tree's root and
    nodes after 7 cached (row 1). Returns the blocked cache, the batch, the layer, q."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(8, KV_HEADS, BLOCK, 2 * DIM, generator=g)
    n = len(PARENTS) + 1
    batch = PagedBatch(query_start_loc=torch.tensor([0, 3, 3 + n], dtype=torch.int32),
                       seq_lens=torch.tensor([5, 7 + n], dtype=torch.int32),
                       block_table=torch.tensor([[3, 0, 0, 0], [5, 1, 7, 2]], dtype=torch.int32))
    layer = AttentionLayer(num_heads=HEADS, num_kv_heads=KV_HEADS, head_size=DIM, scale=0.3, block_size=BLOCK)
    return kv, batch, layer, torch.randn(3 + n, HEADS, DIM, generator=g)


def _oracle(q, kv, batch, layer):
    """Dense attention from the blocked cache: row 0 causal, row 1's pass under its tree mask."""
    k, v = BLOCKED.split(kv)
    out = torch.empty_like(q)
    for row, (q0, q1) in enumerate([(0, 3), (3, q.shape[0])]):
        n = int(batch.seq_lens[row])
        pos = torch.arange(n)
        blk = batch.block_table[row][pos // BLOCK].long()
        keys, values = k[blk, :, pos % BLOCK], v[blk, :, pos % BLOCK]  # [n, H_kv, D]
        r = q1 - q0
        allowed = torch.ones(r, n, dtype=torch.bool)
        if row == 0:
            allowed = torch.arange(n)[None, :] <= torch.arange(n - r, n)[:, None]
        else:
            allowed[:, n - r:] = False
            allowed[0, n - r] = True  # the root sees itself
            for i, p in enumerate(PARENTS):  # node i: query row 1 + i, key n - r + 1 + i
                allowed[1 + i, n - r] = True
                allowed[1 + i, n - r + 1 + i] = True
                while p >= 0:
                    allowed[1 + i, n - r + 1 + p] = True
                    p = PARENTS[p]
        g = HEADS // KV_HEADS
        s = torch.einsum("qhd,khd->hqk", q[q0:q1], keys.repeat_interleave(g, 1)) * layer.scale
        p_ = s.masked_fill(~allowed, float("-inf")).softmax(-1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", p_, values.repeat_interleave(g, 1))
    return out


@pytest.mark.parametrize("cache_name", CACHES)
@pytest.mark.parametrize("others", [True, False], ids=["mixed", "trees-only"])
def test_tree_attention_in_each_layout_matches_the_oracle_on_the_device(device, monkeypatch, cache_name, others):
    kv, batch, layer, q = _case()
    expected = _oracle(q, kv, batch, layer)
    cache, layer = in_cache(kv, layer, cache_name)
    if not others:  # row 1 alone: every row is a tree's, no causal pass at all
        batch = PagedBatch(batch.query_start_loc[1:] - 3, batch.seq_lens[1:], batch.block_table[1:])
        q, expected = q[3:], expected[3:]
    row = 1 if others else 0
    monkeypatch.setattr(T._state(), "tree_verifier", verifier_with({row: step_tree(PARENTS, start=3 if others else 0, context=7)},
                                                    others=others))
    method = T.TreeAttention(None)
    with device:
        q_d, cache_d = device.put(q, cache)
        batch_d = PagedBatch(*device.put(batch.query_start_loc, batch.seq_lens, batch.block_table))
        plan, outs = plan_and_layers(device, method, q_d, cache_d, batch_d, layer, LAYERS)
        assert plan.kernel is not None  # CUDA tensors: the Triton kernel computes the tree rows
        assert plan.layout is layer.kv_layout
        assert all(o.device == q_d.device for o in outs)
        for o in outs:
            torch.testing.assert_close(o.cpu(), expected, atol=1e-5, rtol=1e-5)
    if getattr(device, "real", False):
        return
    per = device.sync_counts()
    # no layer reads anything back to the host after the first; the first indexes the causal
    # rows' step once (plugins/attention/_shared), and a batch of trees only syncs never
    assert all(per.get(f"layer {i}", 0) == 0 for i in range(1, LAYERS)), device.report()
    assert per.get("layer 0", 0) <= (4 if others else 0), device.report()
    assert per.get("plan (step)", 0) == 0, device.report()


def test_the_host_path_is_the_reference_and_is_logged_once(monkeypatch, caplog):
    kv, batch, layer, q = _case()
    monkeypatch.setattr(T._state(), "tree_verifier", verifier_with({1: step_tree(PARENTS, start=3, context=7)}, others=True))
    monkeypatch.setattr(T.RUNTIME, "said", set())
    method = T.TreeAttention(None)
    with caplog.at_level("INFO", logger="vllm_graft"):
        plan = method.plan(batch)
        for _ in range(LAYERS):
            out = method.forward(q, kv, batch, layer, plan)
    assert plan.kernel is None
    torch.testing.assert_close(out, _oracle(q, kv, batch, layer), atol=1e-5, rtol=1e-5)
    logged = [r.getMessage() for r in caplog.records if "tree rows by" in r.getMessage()]
    assert logged == ["vllm-graft tree verification: tree rows by the PyTorch reference "
                      "(_tree.verify_pass_attention) on cpu"]


@pytest.mark.parametrize("physical", ["NHD", "HND"])
def test_move_kv_in_the_packed_layout_moves_the_right_rows_on_the_device(device, physical):
    n, hkv, bs, c = 6, 2, 4, 8
    g = torch.Generator().manual_seed(1)
    caches = []
    for _ in range(2):
        if physical == "NHD":
            caches.append(torch.randn(n, bs, hkv, c, generator=g).permute(0, 2, 1, 3))
        else:
            caches.append(torch.randn(n, hkv, bs, c, generator=g))
    before = [x.clone() for x in caches]
    src, dst = [9, 14, 3], [6, 7, 8]  # slot = block * 4 + offset
    with device:
        dev = [device.put(x) for x in caches]
        with device.region("move"):
            T.move_kv(dev, src, dst, PACKED)
        after = [x.cpu() for x in dev]
    for a, b in zip(after, before):
        for s, d in zip(src, dst):  # the token's key and value (the whole C row) moved
            assert torch.equal(a[d // bs, :, d % bs], b[s // bs, :, s % bs])
        rest = [s for s in range(n * bs) if s not in dst]
        assert all(torch.equal(a[s // bs, :, s % bs], b[s // bs, :, s % bs]) for s in rest)
    if not getattr(device, "real", False):
        assert device.sync_counts().get("move", 0) == 0, device.report()
    # the same moves read as blocked would scramble a packed cache: the layout matters
    wrong = [x.contiguous() for x in before]
    T.move_kv(wrong, src, dst, BLOCKED)
    assert not all(torch.equal(w, a) for w, a in zip(wrong, after))


def test_a_tree_step_on_the_device_in_the_packed_layout(device):
    """prepare (positions) -> plan -> every layer's attention -> verify (verdict, KV moves), the
    runner's tensors on the device and its cache packed, as on vLLM's CUDA backends."""
    runner = _runner()
    tokens, parents = [11, 12, 13, 14], [-1, -1, 1, 2]  # root -> 11 | root -> 12 -> 13 -> 14
    blocked = runner.kv_caches[0]  # [6, 2, 4, 2*4]
    layer = AttentionLayer(num_heads=4, num_kv_heads=2, head_size=4, scale=0.5, block_size=4)
    cache, layer = in_cache(blocked, layer, "packed-NHD")
    before = cache.clone()
    logits = torch.zeros(6, 20)
    for row, best in enumerate([3, 12, 0, 13, 0, 9]):  # root -> 12, 12 -> 13, 13 -> 0 (14 rejected)
        logits[row, best] = 5.0
    sampled = torch.tensor([[3, -1, -1, -1, -1], [12, 0, 0, 0, 0]], dtype=torch.int32)
    q = torch.randn(6, 4, 4, generator=torch.Generator().manual_seed(2))
    with device:
        runner.positions = device.put(runner.positions)
        runner.kv_caches = [device.put(cache)]
        logits, sampled, q = device.put(logits, sampled, q)
        v = T.TreeVerifier(lambda e, n=1: None)
        with device.region("prepare (step)"):
            v.prepare(runner, {"r": (tokens, parents)}, np.array([1, 5]))
        # row 0: one decode token after 9; row 1: the root at 6 and four nodes (blocks 2, 5, 3)
        batch = PagedBatch(*device.put(torch.tensor([0, 1, 6], dtype=torch.int32), torch.tensor([10, 11], dtype=torch.int32),
                                       torch.tensor([[0, 1, 4, 0], [2, 5, 3, 0]], dtype=torch.int32)))
        method = T.TreeAttention(None)
        saved = T.current_verifier()
        T.set_verifier(v)
        try:
            plan, outs = plan_and_layers(device, method, q, runner.kv_caches[0], batch, layer, LAYERS)
        finally:
            T.set_verifier(saved)
        assert plan.kernel is not None and plan.layout is PACKED
        with device.region("verify (step)"):
            v.verify(runner, logits, type("M", (), {"num_draft_tokens": [0, 4]})(),
                     out := type("O", (), {"sampled_token_ids": sampled})())
        assert runner.positions.cpu().tolist() == [100, 101, 7, 7, 8, 9]  # depths after position 6
        assert out.sampled_token_ids.device == logits.device
        assert out.sampled_token_ids.cpu().tolist() == [[3, -1, -1, -1, -1], [12, 13, 0, -1, -1]]
        moved = runner.kv_caches[0].cpu()
    # node 1 (token 12) from slot 12 to 23 (position 7), node 2 (13) from 13 to 12 (position 8)
    assert torch.equal(moved[23 // 4, :, 23 % 4], before[12 // 4, :, 12 % 4])
    assert torch.equal(moved[12 // 4, :, 12 % 4], before[13 // 4, :, 13 % 4])
    if not getattr(device, "real", False):
        per = device.sync_counts()
        assert all(per.get(f"layer {i}", 0) == 0 for i in range(1, LAYERS)), device.report()
        assert per.get("prepare (step)", 0) == 0 and per.get("plan (step)", 0) == 0, device.report()
        assert per.get("verify (step)", 0) <= 1, device.report()  # the greedy trees' argmax, once
