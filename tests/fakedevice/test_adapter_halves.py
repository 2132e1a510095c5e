"""The adapters' other vLLM-free halves with vLLM's tensors on the (fake) device: the MoE
chain every MoE deployment runs per layer, the tree verifier's attention and verdict, and the
speculative adapter's drafting. Each must keep the device of what it is given and say what it
reads back to the host (a sync per layer is a GPU stall even where it is correct)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from vllm_graft.hooks import BLOCKED, AttentionLayer, MoEModel, PagedBatch, get_registry, split_kv_cache
from vllm_graft.integration.adapters.moe.chain import MoEChain
from vllm_graft.kit.conformance.checks import example_params
from vllm_graft.kit.conformance.exercises.moe import MOE_EXPERTS, MOE_LAYERS, MOE_TOKENS, MOE_TOPK, model_topk


def _moe_chain():
    reg = get_registry()
    out = []
    for e in reg.entries():
        if e.kind.value != "moe" or e.source.package != "vllm-graft":
            continue
        r = e.registration
        impl = r.load()(r.params(**example_params(e)))
        impl.bind(MoEModel(num_layers=MOE_LAYERS, num_experts=MOE_EXPERTS, top_k=MOE_TOPK, model="fake-device"))
        out.append((e.name, impl))
    return MoEChain(out)


def test_every_moe_scheduler_composed_in_one_chain_keeps_the_router_device(device):
    chain = _moe_chain()
    assert len(chain.schedulers) >= 5  # every built-in scheduler (route, adjust, observe)
    g = torch.Generator().manual_seed(3)
    with device:
        for layer in range(MOE_LAYERS):
            logits = device.put(torch.randn(MOE_TOKENS, MOE_EXPERTS, generator=g))
            with device.region(f"layer {layer}"):
                w, ids = chain(layer, logits, MOE_TOPK, True, lambda x: model_topk(x, MOE_TOPK, True))
            assert w.device == logits.device and ids.device == logits.device
            assert tuple(ids.shape) == (MOE_TOKENS, MOE_TOPK)
    if not getattr(device, "real", False):
        # the observers (placement statistics, expert cache, route trace) read the routing back
        # to the host per layer: reported, bounded
        per_layer = [device.sync_counts().get(f"layer {i}", 0) for i in range(MOE_LAYERS)]
        assert max(per_layer) <= 8, device.report()


def test_tree_attention_runs_on_the_device_and_matches_the_host(device, monkeypatch):
    from tests.unit.test_spec_tree_engine import step_tree, verifier_with
    from vllm_graft.integration.adapters.speculative import tree as T

    torch.manual_seed(0)
    heads, kv_heads, dim, block = 4, 2, 8, 4
    cache = torch.randn(8, kv_heads, block, 2 * dim)
    parents = [-1, -1, 0, 1, 1]
    qsl, lens = torch.tensor([0, 3, 9], dtype=torch.int32), torch.tensor([5, 13], dtype=torch.int32)
    table = torch.tensor([[3, 0, 0, 0], [5, 1, 7, 2]], dtype=torch.int32)
    layer = AttentionLayer(num_heads=heads, num_kv_heads=kv_heads, head_size=dim, scale=0.3, block_size=block)
    q = torch.randn(9, heads, dim)
    method = T.TreeAttention(None)
    monkeypatch.setattr(T._state(), "tree_verifier", verifier_with({1: step_tree(parents, start=3, context=7)}, others=True))
    host = method.forward(q, cache, PagedBatch(qsl, lens, table), layer, method.plan(PagedBatch(qsl, lens, table)))
    with device:
        dq, dcache, dqsl, dlens, dtable = device.put(q, cache, qsl, lens, table)
        batch = PagedBatch(dqsl, dlens, dtable)
        out = method.forward(dq, dcache, batch, layer, method.plan(batch))
        assert out.device == dq.device
        torch.testing.assert_close(out.cpu(), host)


def test_the_tree_verifier_moves_kv_and_writes_its_verdict_on_the_device(device):
    from tests.unit.test_spec_tree_engine import _runner
    from vllm_graft.integration.adapters.speculative import tree as T

    runner = _runner()
    tokens, parents = [11, 12, 13, 14], [-1, -1, 1, 2]
    logits = torch.zeros(6, 20)
    for row, best in enumerate([3, 12, 0, 13, 0, 9]):
        logits[row, best] = 5.0
    sampled = torch.tensor([[3, -1, -1, -1, -1], [12, 0, 0, 0, 0]], dtype=torch.int32)
    before = runner.kv_caches[0].clone()
    with device:
        runner.positions = device.put(runner.positions)
        runner.kv_caches = [device.put(runner.kv_caches[0])]
        logits, sampled = device.put(logits, sampled)
        v = T.TreeVerifier(lambda e, n=1: None)
        v.prepare(runner, {"r": (tokens, parents)}, np.array([1, 5]))
        v.plan(PagedBatch(*device.put(torch.tensor([0, 1, 6], dtype=torch.int32), torch.tensor([10, 11]),
                                      torch.zeros(2, 4, dtype=torch.int32)))).layout = BLOCKED
        with device.region("verify (step)"):
            v.verify(runner, logits, SimpleNamespace(num_draft_tokens=[0, 4]),
                     out := SimpleNamespace(sampled_token_ids=sampled))
        assert out.sampled_token_ids.device == logits.device
        assert out.sampled_token_ids.cpu().tolist() == [[3, -1, -1, -1, -1], [12, 13, 0, -1, -1]]
        for part, old in zip(split_kv_cache(runner.kv_caches[0]), split_kv_cache(before)):
            assert torch.equal(part[23 // 4, :, 23 % 4].cpu(), old[12 // 4, :, 12 % 4])
