"""Tree verification's engine side without an engine (integration/adapters/speculative/tree.py and
the tree path of drafting.py): drafts kept per request, cut to a chain where the verifier cannot
reproduce vLLM's sampling, node positions by depth, the tree-masked attention against a dense
oracle, the verdict written over vLLM's sampled tokens, and the accepted nodes' KV moved.
The whole path in vLLM's CPU engine: tests/e2e/test_spec_proposers.py (tree cases)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_graft.hooks import BLOCKED, AttentionLayer, PagedBatch, Proposer, split_kv_cache
from vllm_graft.integration.adapters.speculative import tree as T
from vllm_graft.integration.adapters.speculative.drafting import Drafting, first_path, is_chain
from vllm_graft.integration.plan import plan_for


class Trees(Proposer):
    """Drafts a fixed tree (or whatever ``self.answer`` is) after any context."""

    drafts_trees = True

    def __init__(self, answer=([5, 6, 7, 8], [-1, -1, 0, 2])):
        super().__init__(None)
        self.answer = answer

    def propose(self, request_id, token_ids, max_tokens):  # pragma: no cover - not asked
        raise AssertionError("a tree proposer is asked propose_tree()")

    def propose_tree(self, request_id, token_ids, max_nodes):
        return self.answer


def _drafting(plugin, k=8):
    counts = {}
    d = Drafting(plugin, "trees", k=k, max_model_len=100, vocab_size=50,
                 count=lambda e, n=1: counts.__setitem__(e, counts.get(e, 0) + n))
    return d, counts


def _propose(d, rows=("a",), **kw):
    tokens = np.zeros((len(rows), 100), dtype=np.int32)
    tokens[:, :3] = [1, 2, 3]
    return d.propose(list(rows), [[3]] * len(rows), [3] * len(rows), tokens, **kw)


def test_first_path_and_is_chain():
    assert is_chain([-1, 0, 1]) and is_chain([]) and not is_chain([-1, -1])
    # node 0 -> its first child 2 -> its first child 3; node 1 (a sibling of 0) is left out
    assert first_path([5, 6, 7, 8, 9], [-1, -1, 0, 2, 2]) == ([5, 7, 8], [-1, 0, 1])


def test_drafting_keeps_trees_for_the_step_that_verifies_them():
    d, counts = _drafting(Trees())
    assert _propose(d) == [[5, 6, 7, 8]]  # the nodes, flattened in index order, are vLLM's drafts
    assert d.tree_drafts == {"a": [-1, -1, 0, 2]} and counts["trees"] == 1
    d.step_started([], {"a": [5, 6, 7]})  # vLLM trimmed the last node (length limit)
    assert d.step_trees == {"a": ([5, 6, 7], [-1, -1, 0])}
    assert d.tree_drafts == {}


def test_drafting_cuts_trees_to_a_chain_where_asked_and_drops_seeded_drafts():
    d, counts = _drafting(Trees())
    assert _propose(d, rows=("a", "b", "c"), chain_only={"b"}, seeded={"c"}) == [[5, 6, 7, 8], [5, 7, 8], []]
    assert set(d.tree_drafts) == {"a"}  # the chain goes to vLLM's verifier, nothing to keep
    assert counts["tree_cut_to_chain"] == 1 and counts["seeded_undrafted"] == 4


def test_drafting_clips_trees_to_the_budget_and_keeps_chains_as_chains():
    d, _ = _drafting(Trees(), k=3)
    assert _propose(d) == [[5, 6, 7]]
    assert d.tree_drafts == {"a": [-1, -1, 0]}
    d, _ = _drafting(Trees(([4, 5], [-1, 0])))
    assert _propose(d) == [[4, 5]] and d.tree_drafts == {}


@pytest.mark.parametrize("answer", [([1, 2], [-1, 1]), ([1, 2], [-1]), ([1], [0]), ([1, 99], [-1, 0]), 7])
def test_drafting_refuses_bad_trees(answer):
    d, _ = _drafting(Trees(answer))
    with pytest.raises(ValueError, match=r"propose_tree\(\) must return"):
        _propose(d)


def test_tree_verifiable_accepts_greedy_and_plain_temperature_only():
    from vllm import SamplingParams

    assert T.tree_verifiable(SamplingParams(temperature=0.0))
    assert T.tree_verifiable(SamplingParams(temperature=0.7, seed=3))
    for bad in ({"top_p": 0.9}, {"top_k": 5}, {"min_p": 0.1}, {"logprobs": 2},
                {"presence_penalty": 0.5}, {"repetition_penalty": 1.1}, {"bad_words": ["x"]}):
        assert not T.tree_verifiable(SamplingParams(temperature=0.7, **bad)), bad
    assert not T.tree_verifiable(None)


def _cache(num_blocks=6, heads=2, block=4, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, heads, block, 2 * dim, generator=g)


def step_tree(parents, start, context, slots=None):
    """A tree's entry in the verifier's step (tokens do not matter to the attention)."""
    from vllm_graft.plugins.speculative._tree import DraftTree, ancestor_mask

    tree = DraftTree(list(range(1, len(parents) + 1)), parents)
    mask = ancestor_mask([-1, *(p + 1 for p in parents)])  # the root as node 0
    slots = np.zeros(len(parents) + 1, dtype=np.int64) if slots is None else slots
    return T.StepTree(tree, slots, mask, start, context)


def verifier_with(step, others):
    """A TreeVerifier whose step holds ``step`` (batch row -> StepTree)."""
    v = T.TreeVerifier(lambda e, n=1: None)
    v.step, v.others = dict(step), others
    return v


def test_move_kv_copies_keys_and_values_between_slots():
    caches = [_cache(seed=1), _cache(seed=2)]
    before = [c.clone() for c in caches]
    T.move_kv(caches, [9, 14], [6, 7])  # slot = block * 4 + offset
    for c, b in zip(caches, before):
        for src, dst in ((9, 6), (14, 7)):
            for part, old in zip(split_kv_cache(c), split_kv_cache(b)):
                assert torch.equal(part[dst // 4, :, dst % 4], old[src // 4, :, src % 4])
        rest = [s for s in range(24) if s not in (6, 7)]
        for part, old in zip(split_kv_cache(c), split_kv_cache(b)):
            assert all(torch.equal(part[s // 4, :, s % 4], old[s // 4, :, s % 4]) for s in rest)


def _dense_tree_attention(q, keys, values, allowed, scale, group):
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    s = torch.einsum("nhd,thd->hnt", q, keys) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hnt,thd->nhd", torch.softmax(s, -1), values)


def test_tree_attention_method_masks_node_rows_and_leaves_the_others_causal(monkeypatch):
    torch.manual_seed(0)
    heads, kv_heads, dim, block = 4, 2, 8, 4
    cache = _cache(num_blocks=8, heads=kv_heads, block=block, dim=dim)
    parents = [-1, -1, 0, 1, 1]  # five nodes after the root
    # sequence 0: a prefill chunk of 3 tokens after 2 cached; sequence 1: root + the tree, 7 cached
    batch = PagedBatch(query_start_loc=torch.tensor([0, 3, 9], dtype=torch.int32),
                       seq_lens=torch.tensor([5, 13], dtype=torch.int32),
                       block_table=torch.tensor([[3, 0, 0, 0], [5, 1, 7, 2]], dtype=torch.int32))
    layer = AttentionLayer(num_heads=heads, num_kv_heads=kv_heads, head_size=dim, scale=0.3, block_size=block)
    q = torch.randn(9, heads, dim)
    monkeypatch.setattr(T._state(), "tree_verifier", verifier_with({1: step_tree(parents, start=3, context=7)}, others=True))
    method = T.TreeAttention(None)
    out = method.forward(q, cache, batch, layer, method.plan(batch))
    k, v = split_kv_cache(cache)

    def seq(bt, n):  # keys/values of a sequence's first n positions
        pos = torch.arange(n)
        return k[bt[pos // block].long(), :, pos % block], v[bt[pos // block].long(), :, pos % block]

    k0, v0 = seq(batch.block_table[0], 5)
    causal = torch.tril(torch.ones(3, 5, dtype=torch.bool), diagonal=2)
    assert torch.allclose(out[:3], _dense_tree_attention(q[:3], k0, v0, causal, 0.3, 2), atol=1e-5)
    k1, v1 = seq(batch.block_table[1], 13)
    allowed = torch.zeros(6, 13, dtype=torch.bool)
    allowed[:, :8] = True  # the context and the root (position 7)
    for i, p in enumerate(parents):  # node i is query row 1 + i, key 8 + i
        allowed[1 + i, 8 + i] = True
        while p >= 0:
            allowed[1 + i, 8 + p] = True
            p = parents[p]
    assert torch.allclose(out[3:], _dense_tree_attention(q[3:], k1, v1, allowed, 0.3, 2), atol=1e-5)
    # the mask matters: plain causal attention differs on the nodes with non-ancestors before them
    plain = method.forward(q, cache, batch, layer, None)
    assert torch.allclose(plain[:4], out[:4], atol=1e-5) and not torch.allclose(plain[5:], out[5:], atol=1e-3)
    # a batch of tree requests only; and the engine's path equals the oracle tree_attention
    solo = PagedBatch(query_start_loc=torch.tensor([0, 6], dtype=torch.int32), seq_lens=batch.seq_lens[1:],
                      block_table=batch.block_table[1:])
    monkeypatch.setattr(T._state(), "tree_verifier", verifier_with({0: step_tree(parents, start=0, context=7)}, others=False))
    solo_plan = method.plan(solo)
    assert solo_plan.kernel is None  # host tensors: the PyTorch reference
    assert torch.allclose(method.forward(q[3:], cache, solo, layer, solo_plan), out[3:], atol=1e-6)
    from vllm_graft.plugins.speculative._tree import tree_attention

    kb, vb = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
    oracle = tree_attention(q[4:], kb, vb, batch.block_table[1], 8, k1[8:], v1[8:], torch.tensor(parents), 0.3)
    assert torch.allclose(out[4:], oracle, atol=1e-5)


def _runner(context=6, block=4):
    """A stand-in for vLLM's model runner with one request in batch row 1 (row 0: another one)."""
    table = np.array([[0, 0, 0, 0], [2, 5, 3, 0]], dtype=np.int32)
    block_table = SimpleNamespace(block_size=block, get_numpy_array=lambda: table)
    batch = SimpleNamespace(req_id_to_index={"x": 0, "r": 1}, num_computed_tokens_cpu=np.array([9, context]),
                            req_ids=["x", "r"], generators={}, block_table=_Tables(block_table))
    runner = SimpleNamespace(input_batch=batch, query_start_loc=SimpleNamespace(np=np.array([0, 1, 6])),
                             positions=torch.arange(6, dtype=torch.int64) + 100,
                             requests={"r": SimpleNamespace(sampling_params=SimpleNamespace(temperature=0.0))},
                             kv_caches=[_cache(num_blocks=6, heads=2, block=block, dim=4)])
    return runner


class _Tables(list):
    """vLLM's MultiGroupBlockTable: one group."""

    def __init__(self, table):
        super().__init__([table])
        self.block_tables = [table]


def test_verifier_positions_verdict_and_kv_moves():
    runner = _runner()
    events = {}
    v = T.TreeVerifier(lambda e, n=1: events.__setitem__(e, events.get(e, 0) + n))
    tokens, parents = [11, 12, 13, 14], [-1, -1, 1, 2]  # root -> 11 | root -> 12 -> 13 -> 14
    v.prepare(runner, {"r": (tokens, parents), "gone": ([1], [-1])}, np.array([1, 5]))
    assert runner.positions.tolist() == [100, 101, 7, 7, 8, 9]  # depths 1, 1, 2, 3 after position 6
    assert v.others  # row 0 ("x") has a token and no tree
    (t,) = v.step.values()
    assert (t.start, t.context) == (1, 6)
    # positions 6..10 of row 1 in blocks [2, 5, 3] of 4: slots 5*4+2, 5*4+3, 3*4+0, 3*4+1, 3*4+2
    assert t.slots.tolist() == [22, 23, 12, 13, 14]
    # logits rows: row 0 of request "x" (no drafts), then root + 4 nodes of "r"
    vocab = 20
    logits = torch.zeros(6, vocab)
    for row, best in enumerate([3, 12, 0, 13, 0, 9]):  # root -> 12, 12 -> 13, 13 -> 0 (14 rejected)
        logits[row, best] = 5.0
    sampled = torch.tensor([[3, -1, -1, -1, -1], [12, 0, 0, 0, 0]], dtype=torch.int32)  # vLLM's chain verdict
    before = runner.kv_caches[0].clone()
    with pytest.raises(RuntimeError, match="layout is unknown"):  # no attention layer ran the plan
        v.verify(runner, logits, SimpleNamespace(num_draft_tokens=[0, 4]), SimpleNamespace(sampled_token_ids=sampled.clone()))
    v.prepare(runner, {"r": (tokens, parents)}, np.array([1, 5]))
    plan = v.plan(SimpleNamespace(query_start_loc=torch.tensor([0, 1, 6], dtype=torch.int32)))
    plan.layout = BLOCKED  # what the attention layers record
    v.verify(runner, logits, SimpleNamespace(num_draft_tokens=[0, 4]), SimpleNamespace(sampled_token_ids=sampled))
    assert sampled.tolist() == [[3, -1, -1, -1, -1], [12, 13, 0, -1, -1]]  # path 12, 13 + bonus 0
    # node 1 (token 12) moves from slot 12 to 23 (position 7), node 2 (13) from 13 to 12 (position 8)
    for part, old in zip(split_kv_cache(runner.kv_caches[0]), split_kv_cache(before)):
        assert torch.equal(part[23 // 4, :, 23 % 4], old[12 // 4, :, 12 % 4])
        assert torch.equal(part[12 // 4, :, 12 % 4], old[13 // 4, :, 13 % 4])
    assert events == {"tree_verify": 1, "tree_accepted": 2} and v.step == {}


def test_verifier_leaves_chunked_or_invalidated_trees_to_vllm():
    runner = _runner()
    v = T.TreeVerifier(lambda e, n=1: None)
    v.prepare(runner, {"r": ([11, 12], [-1, -1])}, np.array([1, 2]))  # 2 scheduled, tree needs 3
    v.prepare(runner, {"r": ([11, -1, 5, 6], [-1, -1, 1, 2])}, np.array([1, 5]))  # a slot invalidated
    assert v.step == {} and runner.positions.tolist() == list(range(100, 106))


def test_tree_mode_refuses_what_it_cannot_run_with():
    """The activation-time backstop (validation refuses the same for a proposer whose `tree`
    parameter turns trees on: tests/unit/test_combinations.py): plans built past validation."""
    from vllm_graft.integration import bridge

    plan = plan_for({"model": "models/graft-tiny-llama",
                     "speculative": {"plugin": "token-recycling", "params": {"tree": True}}}, source="test")
    (e,) = plan.by_kind("speculative")
    plan.enabled += plan_for({"model": "models/graft-tiny-llama", "kvcompress": {"plugin": "streaming"}}).enabled
    with pytest.raises(ValueError, match="cannot be combined with 'streaming'"):
        T.drafts_trees(e, plan)
    plan.enabled = [e]
    plan.deployment.engine["tensor_parallel_size"] = 2
    with pytest.raises(ValueError, match="one rank"):
        T.drafts_trees(e, plan)
    plan.deployment.engine["tensor_parallel_size"] = 1
    plan.deployment.engine["pipeline_parallel_size"] = 2
    with pytest.raises(ValueError, match="one rank"):
        T.drafts_trees(e, plan)
    plan.deployment.engine["pipeline_parallel_size"] = 1
    for platform in ("cpu", "cuda", None):  # CUDA: the Triton tree kernel, Model Runner V1
        plan.platform = platform
        assert T.drafts_trees(e, plan) is True
    for platform in ("rocm", "xpu", "tpu"):
        plan.platform = platform
        with pytest.raises(ValueError, match=f"platform '{platform}' has neither path"):
            T.drafts_trees(e, plan)
    plan.platform = "cuda"
    plan.deployment.engine["tensor_parallel_size"] = 2  # still one rank on CUDA
    with pytest.raises(ValueError, match="one rank"):
        T.drafts_trees(e, plan)


def test_tree_patches_are_v1_only_so_the_runner_selects_v1():
    """On CUDA the tree's patches (GPUModelRunner._prepare_inputs, _sample) are Model Runner V1's:
    integration/model_runner.py sets VLLM_USE_V2_MODEL_RUNNER=0, or refuses an explicit 1."""
    from vllm_graft.integration import targets
    from vllm_graft.integration import model_runner as runner

    patches = [targets.SPEC_SAMPLE, targets.SPEC_UPDATE_STATES, targets.SPEC_PREPARE_INPUTS]
    assert all(p.runner == "v1" for p in patches)
    assert targets.SPEC_PREPARE_INPUTS.params == ("scheduler_output", "num_scheduled_tokens")
    assert targets.SPEC_SAMPLE.params == ("logits", "spec_decode_metadata")
    assert runner.decide(patches, None).set_env
    assert "_prepare_inputs" in (runner.decide(patches, "1").refusal or "")
