"""The fault plugins (``fault_plugins.py``) against the adapters' vLLM-free halves: every fault
ends in an error naming the plugin and the rule, or (drafts beyond ``max_tokens``) in the
documented fallback, logged once. The same faults in vLLM's engine: tests/e2e/test_faults.py."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from vllm_graft.hooks import AttentionLayer, KeepError, PagedBatch
from vllm_graft.integration.adapters.plugin_calls import PluginRaised

from . import fault_plugins
from .fault_plugins import FAULT, FaultAttention, FaultKeep, FaultParams, FaultProposer, FaultQuant, FaultRouter, \
    SpecParams


@pytest.fixture(autouse=True)
def no_fault():
    FAULT.mode = None
    yield
    FAULT.mode = None


def on(mode):
    FAULT.mode = mode


# ----------------------------------------------------------------------------------- kvcompress
def free(mode, held=None, num_tokens=70):
    from vllm_graft.integration.adapters.kvcompress.plan import blocks_to_free

    on(mode)
    return blocks_to_free(FaultKeep(FaultParams()), "fault-kvcompress", num_tokens=num_tokens, block_size=32,
                          num_prompt_tokens=num_tokens, held=held or [(False, 1)] * 3)


@pytest.mark.parametrize("mode,rule", [
    ("raise", "keep() raised RuntimeError: injected fault in keep"),
    ("out_of_range", "block(s) [3] are out of range(0, 3)"),
    ("unsorted", "indices must be sorted ascending"),
    ("drop_last", "the last block (2, being written) must be kept"),
])
def test_keep_faults_name_the_plugin_and_the_rule(mode, rule):
    with pytest.raises((KeepError, PluginRaised), match="kvcompress plugin 'fault-kvcompress'") as info:
        free(mode)
    assert rule in str(info.value)


def test_dropping_a_pinned_block_is_refused_in_the_scheduler_half():
    assert free("drop_pinned") == []  # nothing shared: dropping the pinned ones drops nothing
    with pytest.raises(KeepError, match=r"pinned block\(s\) \[0, 1\] \(shared with other requests\) must be kept"):
        free("drop_pinned", held=[(False, 2), (False, 2), (False, 1)])


def test_the_worker_half_names_a_raising_keep():
    from vllm_graft.integration.adapters.kvcompress.plan import blocks_to_skip

    on("raise")
    with pytest.raises(PluginRaised, match="kvcompress plugin 'fault-kvcompress': keep\\(\\) raised"):
        blocks_to_skip(FaultKeep(FaultParams()), "fault-kvcompress", num_tokens=70, block_size=32,
                       num_prompt_tokens=70)


# ---------------------------------------------------------------------------------- speculative
def drafting(k=2):
    from vllm_graft.integration.adapters.speculative.drafting import Drafting

    return Drafting(FaultProposer(SpecParams(num_speculative_tokens=k)), "fault-speculative", k=k,
                    max_model_len=100, vocab_size=50, count=lambda ev, n: None)


def propose(d, mode):
    on(mode)
    ids = np.zeros((2, 100), dtype=np.int32)
    ids[0, :5] = [1, 2, 3, 4, 7]
    return d.propose(["r0"], [[7]], np.array([5, 0]), ids)


def test_a_raising_proposer_is_named():
    with pytest.raises(PluginRaised, match="speculative plugin 'fault-speculative': propose\\(\\) raised RuntimeError"):
        propose(drafting(), "raise")


@pytest.mark.parametrize("mode", ["oov", "not_list", "string"])
def test_malformed_drafts_are_refused(mode):
    with pytest.raises(ValueError, match=r"'fault-speculative' proposed .*propose\(\) must return a list of token "
                                         r"ids in \[0, 50\)"):
        propose(drafting(), mode)


def test_drafts_beyond_max_tokens_are_dropped_and_said_once(caplog):
    d = drafting(k=2)
    with caplog.at_level(logging.WARNING, logger="vllm_graft"):
        assert propose(d, "too_many") == [[7, 7]]
        assert propose(d, "too_many") == [[7, 7]]
    said = [r for r in caplog.records if "proposed 5 drafts where 2 were asked" in r.getMessage()]
    assert len(said) == 1


# ---------------------------------------------------------------------------------------- quant
def linear():
    from vllm_graft.integration.adapters.quant.linear import PluginLinear

    lin = PluginLinear(FaultQuant(FaultParams()), "fault-quant")
    lin.out_features, lin.in_features, lin.names = 4, 3, ("weight",)
    return lin


@pytest.mark.parametrize("mode,rule", [
    ("raise", "apply() raised RuntimeError: injected fault in apply"),
    ("shape", "expected shape (2, 4) in torch.float32"),
    ("dtype", "expected shape (2, 4) in torch.float32"),
])
def test_quant_apply_faults_are_named(mode, rule):
    lin = linear()
    x, w = torch.randn(2, 3), torch.randn(4, 3)
    torch.testing.assert_close(lin.compute(x, [w], None), x @ w.T)
    on(mode)
    with pytest.raises((ValueError, PluginRaised), match="quant plugin 'fault-quant'") as info:
        lin.compute(x, [w], None)
    assert rule in str(info.value)


# ------------------------------------------------------------------------------------------ moe
def route(mode, device=None):
    from vllm_graft.integration.adapters.moe.chain import MoEChain
    from vllm_graft.plugins.moe.noop.reference import softmax_topk

    on(mode)
    chain = MoEChain([("fault-moe", FaultRouter(FaultParams()))])
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    return chain(0, logits, 2, True, lambda x: softmax_topk(x, 2, True))


@pytest.mark.parametrize("mode,rule", [
    ("raise", "route() raised RuntimeError"),
    ("ids_high", "route returned expert ids outside [0, 8) (the layer's experts); MoEScheduler.route must "
                 "return ids of this layer's experts: got ids from 8 to"),
    ("ids_negative", "outside [0, 8)"),
    ("topk_shape", "both must be [T, top_k] = [5, 2]"),
])
def test_moe_route_faults_are_named(mode, rule):
    route(None)  # behaves
    with pytest.raises((ValueError, PluginRaised), match="MoE plugin 'fault-moe'") as info:
        route(mode)
    assert rule in str(info.value)


def test_expert_ids_on_a_device_are_checked_without_a_host_sync():
    from vllm_graft.integration.adapters.moe.chain import check_expert_ids
    from vllm_graft.kit.fakedevice import FakeDevice

    with FakeDevice() as dev:
        good, bad = dev.put(torch.tensor([[0, 7]]), torch.tensor([[0, 8]]))
        check_expert_ids("fault-moe", good, 8)
        with pytest.raises(RuntimeError, match="MoE plugin 'fault-moe': route returned expert ids outside"):
            check_expert_ids("fault-moe", bad, 8)  # torch._assert_async: on CPU data it raises at once
    assert not dev.syncs


# ------------------------------------------------------------------------------------ attention
def attention_forward(mode):
    """The backends' check of a plugin's output (backend.check_output), on the fault plugin."""
    from vllm_graft.integration.adapters.backend import check_output

    layer = AttentionLayer(num_heads=2, num_kv_heads=1, head_size=4, scale=0.5, block_size=4)
    kv = torch.randn(1, 1, 4, 8)  # one block of 4 tokens, one KV head, K and V side by side
    batch = PagedBatch(query_start_loc=torch.tensor([0, 2]), seq_lens=torch.tensor([2]),
                       block_table=torch.tensor([[0]]))
    q = torch.randn(2, 2, 4)
    on(mode)
    method = FaultAttention(FaultParams())
    out = method.forward(q, kv, batch, layer, method.plan(batch))
    check_output("fault-attention", out, (2, 2, 4))
    return out


@pytest.mark.parametrize("mode,rule", [
    ("shape", "returned shape (2, 1, 4), expected (2, 2, 4)"),
    ("dtype", "forward() returned a torch.int32 tensor"),
    ("not_tensor", "forward() returned NoneType"),
])  # a raising forward: tests/e2e/test_faults.py (the backends' try blocks)
def test_attention_output_faults_are_named(mode, rule):
    attention_forward(None)
    with pytest.raises(RuntimeError, match="attention plugin 'fault-attention'") as info:
        attention_forward(mode)
    assert rule in str(info.value)


def test_every_kind_has_a_fault_plugin():
    from vllm_graft.hooks import KINDS

    _, registry = fault_plugins.registry_with_faults()
    assert {e.name for e in registry.entries() if e.name.startswith("fault-")} == {f"fault-{k}" for k in KINDS}
