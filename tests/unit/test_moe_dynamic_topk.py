"""dynamic-topk (MC-MoE online pruning): properties of the routing rule (reference), the
savings bookkeeping, and the scheduler in a chain. No vLLM. (The Triton kernel against the
reference: tests/unit/test_moe_dynamic_topk_kernel.py.)"""
import math

import pytest
import torch
from pydantic import ValidationError

from vllm_graft.hooks import MoEModel
from vllm_graft.integration.adapters.moe.chain import MoEChain
from vllm_graft.plugins.moe.dynamic_topk import Params
from vllm_graft.plugins.moe.dynamic_topk.reference import DynamicTopK, Savings, dynamic_topk
from vllm_graft.plugins.moe.noop.reference import softmax_topk


def logits(T, E, seed, scale=1.0):
    return torch.randn(T, E, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("criterion", ["mass", "entropy"])
def test_routing_properties(seed, criterion):
    """Never below min_k experts, kept experts are a prefix of the model's top-k, pruned slots
    carry weight 0 and a valid id, weights sum to 1 with renormalize."""
    g = torch.Generator().manual_seed(seed)
    E = int(torch.randint(2, 17, (1,), generator=g))
    k = int(torch.randint(1, E + 1, (1,), generator=g))
    min_k = int(torch.randint(1, k + 1, (1,), generator=g))
    th = float(torch.rand((), generator=g)) * 0.99 + 0.01
    x = logits(24, E, seed, scale=[0.3, 1.0, 5.0][seed % 3])
    for renorm in (True, False):
        w, ids, kept = dynamic_topk(x, k, renorm, threshold=th, criterion=criterion, min_k=min_k)
        w0, ids0 = softmax_topk(x, k, renorm)
        assert w.shape == ids.shape == (24, k) and kept.shape == (24,)
        assert (kept >= min_k).all() and (kept <= k).all() and (kept >= 1).all()
        for t in range(24):
            n = int(kept[t])
            assert ids[t, :n].tolist() == ids0[t, :n].tolist()  # a prefix of the model's top-k
            assert (w[t, n:] == 0).all() and (ids[t, n:] == ids0[t, 0]).all()
            assert (w[t, :n] > 0).all()
        assert ((ids >= 0) & (ids < E)).all()
        if renorm:
            assert torch.allclose(w.sum(-1), torch.ones(24), atol=1e-6)
        else:  # kept experts keep their softmax probability
            mask = w > 0
            assert torch.allclose(w[mask], w0[mask])


def test_mass_rule_on_top2_is_a_threshold_on_the_top_share():
    # shares of the top expert: 0.9, 0.6, exactly 0.75
    x = torch.tensor([[math.log(9.0), 0.0, -9.0], [math.log(1.5), 0.0, -9.0], [math.log(3.0), 0.0, -9.0]])
    w, ids, kept = dynamic_topk(x, 2, True, threshold=0.75)
    assert kept.tolist() == [1, 2, 1]
    assert w[0].tolist() == [1.0, 0.0] and ids[0].tolist() == [0, 0]
    assert w[1].tolist() == pytest.approx([0.6, 0.4])
    # threshold 1.0: a token drops its second expert only if the first holds all the mass
    assert dynamic_topk(x, 2, True, threshold=1.0)[2].tolist() == [2, 2, 2]


def test_entropy_rule():
    sharp = torch.tensor([[20.0, 0, 0, 0]])
    flat = torch.zeros(1, 4)
    assert dynamic_topk(sharp, 2, True, threshold=0.5, criterion="entropy")[2].tolist() == [1]
    assert dynamic_topk(flat, 2, True, threshold=0.5, criterion="entropy")[2].tolist() == [2]
    assert dynamic_topk(flat, 2, True, threshold=1.01, criterion="entropy", min_k=2)[2].tolist() == [2]


def test_savings_bookkeeping():
    s = Savings()
    s.add(0, 2, {1: 3, 2: 1})
    s.add(1, 2, {2: 4})
    assert (s.tokens, s.evaluations, s.full) == (8, 13, 16)
    assert s.saved_share == pytest.approx(3 / 16)
    d = s.describe()
    assert d["kept_histogram"] == {"1": 3, "2": 5} and d["saved_share_per_layer"] == {"0": 0.375, "1": 0.0}
    with pytest.raises(ValueError, match="outside 1..2"):
        s.add(0, 2, {0: 1})


def test_scheduler_counts_what_it_pruned_and_checks_the_model():
    s = DynamicTopK(Params(threshold=0.7))
    s.bind(MoEModel(4, 8, 2))
    x = logits(50, 8, 1, scale=3.0)
    chain = MoEChain([("dynamic-topk", s)])
    w, ids = chain(0, x, 2, True, lambda l: softmax_topk(l, 2, True))
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    pruned = int((w[:, 1] == 0).sum())
    d = s.describe()
    assert d["expert_evaluations"] == 100 - pruned and d["saved_share"] == pytest.approx(pruned / 100, abs=1e-4)
    assert 0 < pruned < 50
    with pytest.raises(ValueError, match="min_k 3 is above the model's top-2"):
        DynamicTopK(Params(min_k=3)).bind(MoEModel(4, 8, 2))
    with pytest.raises(ValueError, match="top-1"):
        DynamicTopK(Params()).bind(MoEModel(4, 8, 1))


def test_params():
    for bad in ({"threshold": 0}, {"threshold": 1.5}, {"min_k": 0}, {"criterion": "top1"}, {"thresh": 0.5}):
        with pytest.raises(ValidationError):
            Params(**bad)


def test_kernel_path_needs_a_gpu_or_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ValueError, match="needs a GPU, or TRITON_INTERPRET=1"):
        DynamicTopK(Params(kernel="triton"))
