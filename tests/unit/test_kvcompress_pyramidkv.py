"""``pyramidkv`` (PyramidKV): per-layer budgets falling from the first layer to the last, each
layer's own window scores, the union freed and the rest masked per layer in the worker, and the
kit's per-layer checks."""

import pytest
import torch
from pydantic import ValidationError

from vllm_graft.hooks import BlockView, KeepError, check_keep_layers, get_registry, union_of_heads
from vllm_graft.plugins.kvcompress.snapkv.reference import SnapKV

from .test_kvcompress_policies import build as _build


def build(**params):
    return _build("pyramidkv", **params)


def test_layer_budgets_fall_linearly_and_average_to_the_budget():
    c = build(budget_blocks=8, min_fraction=0.5)
    view = BlockView(16 * 40, 16, 16 * 40)
    budgets = c.layer_budgets(view, 5)
    assert budgets == [12, 10, 8, 6, 4] and sum(budgets) / 5 == 8
    assert build(budget_blocks=8, min_fraction=1.0).layer_budgets(view, 4) == [8, 8, 8, 8]
    assert c.layer_budgets(view, 1) == [8]


def test_each_layer_keeps_its_own_best_blocks_and_keep_is_their_union():
    c = build(budget_blocks=3, window_tokens=16, sink_blocks=1, min_fraction=1 / 3)
    assert isinstance(c, SnapKV) and c.per_layer and not c.per_head
    # 8 prompt blocks; budgets [5, 3, 1]: sink 0 and window 7 fixed in every layer
    layers = [
        [0.0, 9, 8, 1, 7, 2, 0, 0],
        [0.0, 0, 0, 9, 0, 0, 8, 0],
        [0.0, 5, 5, 5, 5, 5, 5, 0],
    ]
    view = BlockView(8 * 16, 16, 8 * 16, scores=[sum(x) for x in zip(*layers)], layer_scores=layers)
    kept = check_keep_layers(view, c.keep_layers(view), "pyramidkv")
    assert kept == [[0, 1, 2, 4, 7], [0, 3, 7], [0, 7]]
    assert c.keep(view) == union_of_heads(kept) == [0, 1, 2, 3, 4, 7]
    # a cap on the union (2 blocks beside the fixed ones): the two best (1 and 3, both 9) are held,
    # and each layer then reads its best among what is held
    capped = build(budget_blocks=3, window_tokens=16, sink_blocks=1, min_fraction=1 / 3, held_blocks=4)
    assert capped.keep_layers(view) == [[0, 1, 3, 7], [0, 3, 7], [0, 7]]
    # mid-prefill, or within the budget: every layer keeps every block
    assert c.keep_layers(BlockView(5 * 16, 16, 8 * 16, layer_scores=[r[:5] for r in layers])) == [list(range(5))] * 3
    # a block a layer dropped earlier (-inf) is not chosen again by that layer
    gone = [[0.0, float("-inf"), 8, 1, 7, 2, 0, 0], layers[1], layers[2]]
    assert 1 not in c.keep_layers(BlockView(8 * 16, 16, 8 * 16, layer_scores=gone))[0]


def test_bad_parameters_are_refused():
    with pytest.raises(ValidationError, match="held_blocks"):
        build(budget_blocks=8, held_blocks=4)
    with pytest.raises(ValidationError):
        build(min_fraction=0.0)


def test_worker_scores_each_layer_frees_the_union_and_masks_each_layer():
    from vllm_graft.integration.adapters.kvcompress.scores import _Scores, _StepPlan

    B, P = 16, 8 * 16
    comp = build(budget_blocks=2, window_tokens=16, sink_blocks=1, min_fraction=0.5)  # budgets [3, 1]
    events = []
    sc = _Scores(comp, "pyramidkv", lambda ev, n: events.append((ev, n)))
    plan = _StepPlan(
        [("r", P - 4, 4, P, [])], [list(range(8))], torch.ones(4, dtype=torch.bool), None, B, per_layer=True
    )
    plan.head_dropped = [None]
    # the prompt's last step: layer 0 wants block 3, layer 1 block 5 (but has no room)
    m0, m1 = torch.zeros(1, 9), torch.zeros(1, 9)
    m0[0, 3], m1[0, 5] = 4.0, 4.0
    plan.layer_mass = {1: m1, 0: m0}  # as the layers report, keyed by index
    sc.pending = plan
    drops = sc.finalize()
    st = sc.reqs["r"]
    assert [sorted(set(range(8)) - d) for d in st.head_dropped] == [[0, 3, 7], [0, 7]]
    assert drops == {"r": [1, 2, 4, 5, 6]}  # freed: what no layer keeps
    assert ("layer_blocks_dropped", 11) in events
    # the next step: compacted columns hold logical [0, 3, 7, 8]; layer 1 no longer reads block 3
    nxt = _StepPlan([("r", P, 1, P, sorted(st.dropped))], [[0, 3, 7, 8]], torch.zeros(1, dtype=torch.bool), None, B,
                    head_dropped=[st.head_dropped], per_layer=True)
    assert nxt.layer_mask(0, 2, 2, 5)[0].all()
    assert nxt.layer_mask(1, 2, 2, 5)[0].tolist() == [[True, False, True, True, True]] * 2
    assert nxt.layer_mask(1, 2, 2, 5)[1].all()  # a row past the plan's reads everything
    assert nxt.layer_mask(7, 2, 2, 5).all()  # a layer the request has no decision for yet


def test_worker_refuses_a_layer_taking_back_a_block():
    from vllm_graft.integration.adapters.kvcompress.scores import _Scores, _StepPlan

    class Bad:
        needs_scores = per_layer = True
        answers = iter([[[0, 3], [0, 1, 2, 3]], [[0, 1, 3], [0, 3]]])

        def keep_layers(self, view):
            return next(self.answers)

    sc = _Scores(Bad(), "bad", lambda *a: None)
    for _ in range(2):
        p = _StepPlan([("r", 60, 4, 64, [])], [list(range(4))], torch.ones(4, dtype=torch.bool), None, 16,
                      head_dropped=[None], per_layer=True)
        p.layer_mass = {0: torch.ones(1, 4), 1: torch.ones(1, 4)}
        sc.pending = p
        if _ == 1:
            with pytest.raises(KeepError, match="for layer 0 .* which that layer dropped"):
                sc.finalize()
        else:
            sc.finalize()


def test_registered_with_its_paper_and_refused_with_kv4():
    from vllm_graft.hooks.contracts import shape_problems

    reg = get_registry().get("kvcompress", "pyramidkv").registration
    kv4 = get_registry().get("kvcompress", "kv4").registration.load()
    assert "2406.02069" in reg.paper
    # refused with kv4 by its shape (validation runs it; tests/unit/test_kvcompress_shape.py)
    assert [p.other for p in shape_problems("kvcompress", reg.load(), [("kvcompress", "kv4", kv4)])] == ["kvcompress:kv4"]
