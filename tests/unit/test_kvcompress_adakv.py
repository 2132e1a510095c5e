"""AdaKV (``adakv``) and the per-KV-head half of the kvcompress contract, without vLLM: the
allocation of one budget across heads (``adaptive_head_budget``), ``keep_heads`` over random
request histories (each head's answer follows the keep rules, the budget in (head, block)
slots and the ``held_blocks`` cap hold, a head's dropped block stays dropped), the parameter
errors, and the worker's per-head scores (``_Scores``: per-head mass to per-head scores, the
union freed, the per-head mask of the next step, bad answers refused)."""
import random

import pytest
import torch
from pydantic import ValidationError

from vllm_graft.hooks import BlockView, get_registry
from vllm_graft.integration.adapters.kvcompress.keep import KeepError, check_keep, check_keep_heads
from vllm_graft.plugins.kvcompress.adakv.reference import adaptive_head_budget

NEG = float("-inf")


def build(**params):
    reg = get_registry().get("kvcompress", "adakv").registration
    return reg.load()(reg.params(**params))


def test_the_budget_goes_to_the_diffuse_head():
    concentrated = [0.9, 0.05, 0.05, 0.0, 0.0, 0.0]  # one block holds the head's attention
    diffuse = [0.2, 0.2, 0.15, 0.15, 0.15, 0.15]
    chosen = adaptive_head_budget([concentrated, diffuse], range(6), slots=6)
    assert chosen == [{0}, {0, 1, 2, 3, 4}]  # 6 slots: 1 for the concentrated head, 5 for the diffuse one
    # a floor gives every head its own best blocks first
    chosen = adaptive_head_budget([concentrated, diffuse], range(6), slots=6, floor=2)
    assert chosen[0] == {0, 1} and len(chosen[1]) == 4
    # a cap on distinct blocks: once 3 are held only pairs of held blocks fit
    chosen = adaptive_head_budget([concentrated, diffuse], range(6), slots=6, cap=3)
    assert set().union(*chosen) == {0, 1, 2} and chosen == [{0, 1, 2}, {0, 1, 2}]
    # -inf: dropped by that head, never chosen again; slots unused rather than reopened
    chosen = adaptive_head_budget([[NEG, 1, 1, 1], [1, NEG, NEG, NEG]], range(4), slots=8)
    assert chosen == [{1, 2, 3}, {0}]
    # ties: the lower head, then the older block
    assert adaptive_head_budget([[1, 1], [1, 1]], range(2), slots=3) == [{0, 1}, {0}]


def histories(seed, n=40):
    rnd = random.Random(seed)
    for _ in range(n):
        bs = rnd.choice([16, 32])
        prompt = rnd.randrange(1, 40 * bs)
        steps, n_tok = [], rnd.randrange(0, prompt + 1)
        while n_tok < prompt + 10 * bs:
            n_tok += rnd.choice([1, 1, rnd.randrange(1, 3 * bs)])
            steps.append(n_tok)
        yield bs, prompt, steps, rnd


PARAMS = [
    {"budget_blocks": 4, "window_tokens": 16, "sink_blocks": 1},
    {"budget_blocks": 6, "window_tokens": 16, "sink_blocks": 1, "held_blocks": 8, "floor_fraction": 0.5},
    {"budget_blocks": 5, "window_tokens": 40, "sink_blocks": 0, "recent_blocks": 2, "held_blocks": 5},
]


@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize("heads", [1, 2, 4])
def test_keep_heads_over_random_histories(params, heads):
    comp = build(**params)
    budget, cap = params["budget_blocks"], params.get("held_blocks")
    for bs, prompt, steps, rnd in histories(hash((str(params), heads)) & 0xFFFF):
        dropped = [set() for _ in range(heads)]
        scores = [[] for _ in range(heads)]
        last = -(-prompt // bs)
        window = min(max(0, prompt - params["window_tokens"]) // bs, max(0, last - params.get("recent_blocks", 0)))
        for n_tok in steps:
            nb = -(-n_tok // bs)
            for h in range(heads):
                while len(scores[h]) < nb:
                    scores[h].append(rnd.random() ** (1 + 3 * h))  # heads of different concentration
            shown = tuple(tuple(NEG if i in dropped[h] else scores[h][i] for i in range(nb)) for h in range(heads))
            view = BlockView(n_tok, bs, prompt, tuple(sum(c) for c in zip(*shown)), head_scores=shown)
            kept = check_keep_heads(view, comp.keep_heads(view), "adakv")  # each head: the keep rules
            union = sorted(set().union(*map(set, kept)))
            assert comp.keep(view) == union == check_keep(view, union, "adakv")
            fixed = (set(range(min(params["sink_blocks"], nb))) | set(range(window, nb))) \
                if n_tok >= prompt and last > budget else set(range(nb))
            for h in range(heads):
                assert fixed <= set(kept[h]), "sink, window and generated blocks are every head's"
                assert not dropped[h] & set(kept[h]), "a block a head dropped came back for it"
            prompt_fixed = {i for i in fixed if i * bs < prompt}
            if n_tok >= prompt and last > budget:
                free = [set(k) - fixed for k in kept]
                assert sum(map(len, free)) <= heads * max(0, budget - len(prompt_fixed))  # the slots
                if cap is not None:
                    assert len({i for i in union if i * bs < prompt}) <= max(cap, len(prompt_fixed))
            else:
                assert all(k == list(range(nb)) for k in kept)  # mid-prefill / within budget: all
            assert comp.keep_heads(view) == kept  # a function of the view
            for h in range(heads):
                dropped[h] |= set(range(nb)) - set(kept[h])


def test_heads_of_different_concentration_get_different_budgets():
    comp = build(budget_blocks=5, window_tokens=32, sink_blocks=1)
    B, P = 32, 20 * 32  # 20 prompt blocks; fixed: sink 0 and window block 19
    sharp = [0.0] * 20
    sharp[7] = 5.0
    flat = [1.0 - i / 40 for i in range(20)]
    view = BlockView(P, B, P, tuple(a + b for a, b in zip(sharp, flat)), head_scores=(tuple(sharp), tuple(flat)))
    kept = comp.keep_heads(view)
    floor = int(0.2 * 3)  # 3 free slots per head on average, 6 in all
    assert 7 in kept[0] and len(kept[0]) - 2 >= floor
    assert len(kept[1]) - 2 > len(kept[0]) - 2  # the diffuse head takes more of the 6 slots
    assert sum(len(k) - 2 for k in kept) == 6


def test_bad_parameters_are_refused_naming_the_fix():
    with pytest.raises(ValidationError, match="held_blocks .4. must be at least budget_blocks .6."):
        build(budget_blocks=6, held_blocks=4)
    with pytest.raises(ValidationError, match="floor_fraction"):
        build(floor_fraction=1.5)
    with pytest.raises(ValidationError, match="sink_blocks"):  # SnapKV's own checks still apply
        build(budget_blocks=2, sink_blocks=2)


def test_worker_per_head_scores_free_the_union_and_mask_the_rest():
    from vllm_graft.integration.adapters.kvcompress.scores import _Scores, _StepPlan

    B, P = 16, 8 * 16  # 8 prompt blocks
    comp = build(budget_blocks=3, window_tokens=16, sink_blocks=1, floor_fraction=0.0)
    events = []
    sc = _Scores(comp, "adakv", lambda ev, n: events.append((ev, n)))
    # the prompt's last step: per KV head mass [H_kv=2][column]; head 0 wants block 3, head 1 block 5
    mass = torch.zeros(1, 2, 9)
    mass[0, 0, 3], mass[0, 0, 2] = 4.0, 3.0
    mass[0, 1, 5], mass[0, 1, 4] = 4.0, 0.5
    sc.pending = _StepPlan([("r", P - 4, 4, P, [])], [list(range(8))], torch.ones(4, dtype=torch.bool), None, B)
    sc.pending.head_dropped = [None]
    sc.pending.mass = mass
    drops = sc.finalize()
    st = sc.reqs["r"]
    # budget 3 per head, of which sink 0 and window 7 are fixed: 1 free slot per head, 2 in all
    assert [sorted(set(range(8)) - d) for d in st.head_dropped] == [[0, 3, 7], [0, 5, 7]]
    assert drops == {"r": [1, 2, 4, 6]}  # freed: what no head keeps
    assert ("head_blocks_dropped", 10) in events
    # the next step: compacted columns hold logical [0, 3, 5, 7, 8]; each head reads its own
    plan = _StepPlan([("r", P, 1, P, sorted(st.dropped))], [[0, 3, 5, 7, 8]], torch.zeros(1, dtype=torch.bool),
                     None, B, head_dropped=[st.head_dropped])
    mask = plan.head_mask(2, 2, 6)
    assert mask[0].tolist() == [[True, True, False, True, True, True], [True, False, True, True, True, True]]
    assert mask[1].all()  # a row past the plan's reads everything


def test_worker_refuses_bad_per_head_answers():
    from vllm_graft.integration.adapters.kvcompress.scores import _Scores, _StepPlan

    class Bad:
        needs_scores = per_head = True

        def __init__(self, answer):
            self.answer = answer

        def keep_heads(self, view):
            return self.answer(view)

    def run(answer):
        sc = _Scores(Bad(answer), "bad", lambda *a: None)
        for heads_back in (None, "again"):
            sc.pending = _StepPlan([("r", 60, 4, 64, [])], [list(range(4))], torch.ones(4, dtype=torch.bool),
                                   torch.ones(1, 2, 4), 16, head_dropped=[None])
            sc.finalize()

    with pytest.raises(KeepError, match="list of 2 block lists, one per KV head"):
        run(lambda v: [[0, 1, 2, 3]])
    with pytest.raises(KeepError, match="KV head 1 in keep_heads"):
        run(lambda v: [[0, 3], [0, 1]])  # head 1 leaves out the last block
    calls = []

    def flip(view):  # head 0 drops block 1, then keeps it again
        calls.append(1)
        return [[0, 2, 3], [0, 1, 2, 3]] if len(calls) == 1 else [[0, 1, 2, 3], [0, 1, 2, 3]]
    with pytest.raises(KeepError, match="block.s. .1. for KV head 0"):
        run(flip)


# ------------------------------------------------------------------------------ conformance kit
from vllm_graft.hooks import Capabilities, Kind, KVCompressor, NoParams, Registration  # noqa: E402


class _PerHead(KVCompressor):
    """Head 0: sink + last 2 blocks; head 1: everything (its own rule-abiding answer)."""
    needs_scores = per_head = True

    def __init__(self, params=None):
        super().__init__(params or NoParams())

    def keep_heads(self, view):
        n = view.num_blocks
        return [sorted({0, n - 2, n - 1} & set(range(n))), list(range(n))]

    def keep(self, view):
        return sorted(set().union(*map(set, self.keep_heads(view)))) if view.head_scores else list(range(view.num_blocks))

    def attend(self, query, kv_cache, batch, layer, observe, head_mask=None):
        # a scored compressor must attend (the adapter refuses one without): the public helper
        from vllm_graft.plugins.paged import paged_attention_with_mass

        return paged_attention_with_mass(query, kv_cache, batch, layer, observe, head_mask=head_mask)


class HeadComesBack(_PerHead):
    def keep_heads(self, view):  # head 0 keeps a window that moves back over its dropped blocks
        n = view.num_blocks
        return [sorted({0, n // 2, n - 1} & set(range(n))), list(range(n))]


class NotTheUnion(_PerHead):
    def keep(self, view):
        return self.keep_heads(view)[0]


def _target(cls):
    from vllm_graft.hooks.registry import Entry, Source
    from vllm_graft.kit.conformance import checks as c

    reg = Registration(name="subject", kind=Kind.KVCOMPRESS, summary="under test", paper="-", params=NoParams,
                       impl=f"{__name__}:{cls.__name__}", capabilities=Capabilities(lossless=False))
    return c, c.Target(Entry(reg, Source("test-pkg", "0", "subject")), {})


def test_the_conformance_kit_checks_keep_heads():
    c, t = _target(_PerHead)
    assert "keep the kvcompress contract" in c.check_contract(t)
    c, t = _target(HeadComesBack)
    with pytest.raises(c.ConformanceError, match="for KV head 0, which that head dropped earlier"):
        c.check_contract(t)
    c, t = _target(NotTheUnion)
    with pytest.raises(c.ConformanceError, match="not the union of keep_heads"):
        c.check_contract(t)
