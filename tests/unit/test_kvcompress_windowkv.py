"""`windowkv` (WindowKV at block granularity): once the prompt is prefilled it keeps whole windows of
``window_blocks`` consecutive prompt blocks, the best by the observation window's mass summed over
the window, within the budget, besides SnapKV's protected blocks; ``window_blocks: 1`` is SnapKV."""

import random

import pytest
from pydantic import ValidationError

from vllm_graft.hooks import BlockView, DeploymentContext, check_keep, get_registry

from .test_kvcompress_policies import build, histories

INF = float("-inf")
BS = 32


def reg():
    return get_registry().get("kvcompress", "windowkv").registration


def prefilled(scores, prompt=None, bs=BS):
    """The view at the end of prefill: ``scores`` per prompt block (the prompt fills its blocks
    unless ``prompt`` says otherwise)."""
    prompt = len(scores) * bs if prompt is None else prompt
    return BlockView(prompt, bs, prompt, scores=tuple(scores))


def oracle(scores, first, stop, w, room):
    """What WindowKV keeps of the blocks ``[first, stop)``, written out on its own: windows of ``w``
    from ``first``, ranked by their summed score (ties: the older), whole ones taken in that order
    and the first that does not fit cut to its leading blocks."""
    wins = [list(range(a, min(a + w, stop))) for a in range(first, stop, w)]
    wins.sort(key=lambda win: (-sum(scores[i] for i in win), win[0]))
    kept = []
    for win in wins:
        if room <= 0:
            break
        kept += win[:room]
        room -= len(win[:room])
    return set(kept)


# ------------------------------------------------------------------------------ the windows
def test_keeps_the_best_whole_windows_where_snapkv_keeps_the_best_blocks():
    # 14 prompt blocks; sink 0 and the observation window's block 13 are kept, 6 blocks left: 3 windows
    scores = [0.0, 1.0, 1.0, 5.0, 0.0, 0.0, 3.0, 3.0, 0.0, 0.0, 2.0, 9.0, 0.0, 0.5]
    w = build("windowkv", budget_blocks=8, window_blocks=2, sink_blocks=1, window_tokens=32)
    view = prefilled(scores)
    assert w.windows(view) == [range(1, 3), range(3, 5), range(5, 7), range(7, 9), range(9, 11), range(11, 13)]
    # window masses: [1,2] 2, [3,4] 5, [5,6] 3, [7,8] 3, [9,10] 2, [11,12] 9: the best three, the tie to the older
    assert check_keep(view, w.keep(view), "windowkv") == [0, 3, 4, 5, 6, 11, 12, 13]
    # snapkv on the same scores keeps single blocks, splitting the windows
    s = build("snapkv", budget_blocks=8, sink_blocks=1, window_tokens=32)
    assert s.keep(view) == [0, 1, 3, 6, 7, 10, 11, 13]


def test_a_cold_block_is_kept_for_its_window_and_a_hot_lone_block_loses_to_a_warm_window():
    w = build("windowkv", budget_blocks=5, window_blocks=3, sink_blocks=1, window_tokens=32)
    # windows [1,2,3] (mass 6: 0 + 3 + 3) and [4,5,6] (mass 5: 5 + 0 + 0); block 7 is the window's
    view = prefilled([0.0, 0.0, 3.0, 3.0, 5.0, 0.0, 0.0, 0.0])
    assert w.keep(view) == [0, 1, 2, 3, 7]  # block 1 (0 mass) kept, block 4 (the hottest) dropped


def test_a_budget_not_a_multiple_of_the_window_cuts_only_the_last_window_taken_to_its_leading_blocks():
    # 7 blocks left beside the sink and the window's block: two whole windows of 3, then 1 block
    w = build("windowkv", budget_blocks=9, window_blocks=3, sink_blocks=1, window_tokens=32)
    scores = [0.0, 1.0, 1.0, 1.0, 4.0, 4.0, 4.0, 0.0, 2.0, 0.0, 0.0, 0.0, 3.0, 3.0, 0.0]
    # windows: [1-3] 3, [4-6] 12, [7-9] 2, [10-12] 3, [13] 3 (the short one before the window's block 14)
    view = prefilled(scores)
    assert w.windows(view)[-1] == range(13, 14)
    kept = w.keep(view)
    # [4-6] and the older of the tied [1-3], [10-12], [13]: [1-3]; then the leading block of [10-12]
    assert kept == [0, 1, 2, 3, 4, 5, 6, 10, 14]
    assert len(kept) == 9


def test_windows_count_from_the_first_block_after_the_sinks_and_stop_at_the_protected_blocks():
    w = build("windowkv", budget_blocks=8, window_blocks=2, sink_blocks=2, recent_blocks=3, window_tokens=32)
    view = prefilled([0.0] * 12)
    assert w.windows(view) == [range(2, 4), range(4, 6), range(6, 8), range(8, 9)]  # 9, 10, 11 are recent
    # a 64-token window not aligned to the blocks spans 3 blocks, protected from its first on
    w = build("windowkv", budget_blocks=8, window_blocks=2, sink_blocks=1, window_tokens=64)
    view = prefilled([0.0] * 12, prompt=11 * BS + 8)
    assert w.protected_start(view) == 9 and w.windows(view)[-1] == range(7, 9)


@pytest.mark.parametrize("budget, w, sink, recent, window_tokens", [
    (8, 2, 1, 0, 32), (9, 3, 1, 0, 32), (10, 4, 0, 2, 40), (16, 5, 2, 1, 100), (6, 1, 1, 0, 32), (12, 7, 1, 3, 16),
])
def test_random_views_match_the_rule_written_out(budget, w, sink, recent, window_tokens):
    """On seeded random prefilled views: the kept blocks are the fixed ones and exactly what the
    oracle keeps (whole windows, best first, at most one window in part); with room a multiple of
    ``window_blocks`` and whole windows only, no window is cut."""
    c = build("windowkv", budget_blocks=budget, window_blocks=w, sink_blocks=sink, recent_blocks=recent,
              window_tokens=window_tokens)
    rnd = random.Random(budget * 100 + w)
    cut = 0
    for _ in range(200):
        bs = rnd.choice([16, 32])
        prompt = rnd.randrange(budget * bs + 1, 40 * bs)
        nb = -(-prompt // bs)
        scores = [rnd.choice([0.0, 1.0, 2.0, rnd.random() * 5]) for _ in range(nb)]
        view = BlockView(prompt, bs, prompt, scores=tuple(scores))
        kept = set(check_keep(view, c.keep(view), "windowkv"))
        stop = min(nb - recent, max(0, prompt - window_tokens) // bs)
        fixed = set(range(sink)) | set(range(stop, nb))
        assert fixed <= kept, (view, kept)
        room = budget - len(fixed)
        chosen = kept - fixed
        if room <= 0:  # the fixed blocks take the budget: no window
            assert not chosen
            continue
        assert chosen == oracle(scores, sink, stop, w, room), (view, sorted(kept))
        assert len(chosen) == min(room, max(0, stop - sink))  # the budget spent, never exceeded
        wins = [set(range(a, min(a + w, stop))) for a in range(sink, stop, w)]
        partial = [win for win in wins if 0 < len(win & chosen) < len(win)]
        assert len(partial) <= 1
        for win in partial:  # the cut window keeps its leading blocks
            assert win & chosen == set(sorted(win)[:len(win & chosen)])
            cut += 1
        if room % w == 0 and all(len(win) == w for win in wins):
            assert not partial, (view, sorted(kept))
    if budget == 9:  # this case's room (7 of windows of 3) forces a cut: the check above ran
        assert cut


# ------------------------------------------------------------------------------ the policy
def test_protected_blocks_generated_blocks_and_mid_prefill():
    w = build("windowkv", budget_blocks=6, window_blocks=2, sink_blocks=1, recent_blocks=0, window_tokens=48)
    prompt = 12 * BS + 20  # 13 prompt blocks; the window's tokens 356..403 lie in blocks 11 and 12
    scores = [0.0, 9.0, 9.0] + [0.0] * 10
    assert w.protected_start(prefilled(scores, prompt)) == (prompt - 48) // BS == 11
    kept = w.keep(prefilled(scores, prompt))
    assert {0, 11, 12} <= set(kept) and {1, 2} <= set(kept) and len(kept) == 6
    # mid-prefill nothing is dropped; without scores nothing is dropped
    assert w.keep(BlockView(8 * BS, BS, prompt, scores=tuple(scores[:8]))) == list(range(8))
    assert w.keep(BlockView(prompt, BS, prompt)) == list(range(13))
    # generated blocks are all kept, the prompt's selection stays (dropped blocks are -inf)
    assert kept == [0, 1, 2, 3, 11, 12]  # the hot window [1, 2], then the older of the cold ones, cut to 1 block
    later = tuple(INF if i not in kept else v for i, v in enumerate(scores)) + (0.0, 0.0)
    assert w.keep(BlockView(prompt + 70, BS, prompt, scores=later)) == kept + [13, 14]
    # a pinned block (shared through the prefix cache) is kept beside the budget
    pinned = BlockView(prompt, BS, prompt, scores=tuple(scores), pinned=frozenset({5}))
    assert 5 in check_keep(pinned, w.keep(pinned), "windowkv")


def test_budget_held_and_dropped_blocks_never_back_over_random_histories():
    for budget, w, sink in ((6, 2, 1), (9, 3, 1), (12, 4, 0)):
        c = build("windowkv", budget_blocks=budget, window_blocks=w, sink_blocks=sink)
        for bs, prompt, shared, unshare_at, steps, rnd in histories(budget * 7 + w):
            dropped: set[int] = set()
            scores: list[float] = []
            for n_tok in steps:
                nb = -(-n_tok // bs)
                pinned = frozenset(i for i in range(shared) if n_tok < unshare_at and i < nb - 1 and i not in dropped)
                scores += [rnd.random() for _ in range(nb - len(scores))]
                v = BlockView(n_tok, bs, prompt, scores=tuple(INF if i in dropped else s for i, s in enumerate(scores)),
                              pinned=pinned)
                kept = check_keep(v, c.keep(v), "windowkv")
                prompt_kept = [i for i in kept if i * bs < prompt and i not in pinned]
                # the observation window's blocks may exceed the budget (SnapKV's check_deployment warns)
                protected = -(-prompt // bs) - c.protected_start(v)
                assert len(prompt_kept) <= max(budget, sink + protected) or n_tok < prompt, (v, kept)
                assert not dropped & set(kept) and pinned <= set(kept)
                dropped |= set(range(nb)) - set(kept)


def test_window_blocks_1_is_snapkv():
    """By construction (each block its own window, scored by its own mass): the same blocks as
    snapkv with the same parameters, on random prefilled views and over random histories."""
    rnd = random.Random(7)
    for budget, sink, recent, window_tokens in ((4, 1, 0, 32), (8, 2, 1, 50), (16, 0, 3, 16), (5, 1, 0, 90)):
        params = dict(budget_blocks=budget, sink_blocks=sink, recent_blocks=recent, window_tokens=window_tokens)
        wkv, snap = build("windowkv", window_blocks=1, **params), build("snapkv", **params)
        for _ in range(150):
            bs = rnd.choice([16, 32, 128])
            prompt = rnd.randrange(1, 40 * bs)
            n = prompt + rnd.choice([0, 0, rnd.randrange(1, 4 * bs)])
            nb = -(-n // bs)
            scores = tuple(INF if rnd.random() < 0.1 else rnd.choice([0.0, 1.0, rnd.random()]) for _ in range(nb))
            v = BlockView(n, bs, prompt, scores=scores)
            assert wkv.keep(v) == snap.keep(v), v
        for bs, prompt, shared, unshare_at, steps, hrnd in histories(budget):
            dropped: set[int] = set()
            for n_tok in steps:
                nb = -(-n_tok // bs)
                sc = tuple(INF if i in dropped else hrnd.random() for i in range(nb))
                v = BlockView(n_tok, bs, prompt, scores=sc)
                kept = wkv.keep(v)
                assert kept == snap.keep(v), v
                dropped |= set(range(nb)) - set(kept)
    # and a window of 2 on the same view differs (the check above is not vacuous)
    view = prefilled([0.0, 1.0, 1.0, 5.0, 0.0, 0.0, 3.0, 3.0, 0.0, 0.0, 2.0, 9.0, 0.0, 0.5])
    assert build("windowkv", budget_blocks=8, window_blocks=2).keep(view) != build("snapkv", budget_blocks=8).keep(view)


# ------------------------------------------------------------------------------ parameters
@pytest.mark.parametrize("params, msg", [
    ({"window_blocks": 0}, r"window_blocks\n.*greater than or equal to 1"),
    ({"budget_blocks": 1}, "greater than or equal to 2"),
    ({"budget_blocks": 4, "window_blocks": 3},
     r"window_blocks \(3\) does not fit in the budget: budget_blocks \(4\) less sink_blocks \(1\).* leaves 2 blocks"
     r".*set window_blocks to at most 2 or set budget_blocks to at least 5"),
    ({"budget_blocks": 6, "recent_blocks": 3, "window_blocks": 3},
     r"window_blocks \(3\) does not fit.*recent blocks \(at least 3\) leaves 2 blocks"),
    ({"budget_blocks": 4, "sink_blocks": 1, "recent_blocks": 3, "window_blocks": 1},
     r"leaves 0 blocks for windows, so no whole window could be kept; set budget_blocks to at least 5"),
    ({"budget_blocks": 4, "sink_blocks": 4}, r"sink_blocks \(4\) must be smaller than budget_blocks \(4\)"),
    ({"budget_blocks": 8, "keep_ratio": 0.5}, "set budget_blocks .* or keep_ratio .*, not both"),
])
def test_rejects_bad_parameters(params, msg):
    with pytest.raises(ValidationError, match=msg):
        reg().params(**params)


def test_accepts_a_window_that_just_fits_and_any_window_with_keep_ratio():
    assert reg().params(budget_blocks=5, window_blocks=3).window_blocks == 3  # 5 - sink 1 - window's 1
    assert reg().params(keep_ratio=0.25, window_blocks=64).window_blocks == 64  # the budget comes per prompt


def test_checks_its_windows_against_the_deployments_block_size():
    ctx = DeploymentContext(platform="cpu", dtype=None, model=None, block_size=16)
    # 32 tokens span up to 3 blocks of 16: sink 1 + 3 leave 4 of 8, a window of 4 fits and one of 5 does not
    assert reg().params(budget_blocks=8, window_blocks=4).check_deployment(ctx) == []
    problems = reg().params(budget_blocks=8, window_blocks=5).check_deployment(ctx)
    assert len(problems) == 1 and "window_blocks 5" in problems[0] and "spans up to 3 blocks" in problems[0]
    assert "set window_blocks to at most 4 or set budget_blocks to at least 9" in problems[0]
    # SnapKV's own check (the observation window alone over the budget) still comes first
    assert "SnapKV always keeps" in reg().params(budget_blocks=3, window_blocks=1, window_tokens=64) \
        .check_deployment(ctx)[0]
    assert reg().params(keep_ratio=0.5, window_blocks=9).check_deployment(ctx) == []


def test_registered_with_its_paper_lossy_and_tensor_and_data_parallel():
    r = reg()
    assert r.name == "windowkv" and "2503.17922" in r.paper and "WindowKV" in r.paper
    assert not r.capabilities.lossless
    assert r.capabilities.parallelism == ("tp", "dp")  # its two-rank case: tests/e2e/test_tensor_parallel.py
    from vllm_graft.plugins.kvcompress.snapkv.reference import SnapKV
    cls = r.load()
    assert issubclass(cls, SnapKV) and cls.scope == "prompt" and cls.when == "prefill" and cls.needs_scores
