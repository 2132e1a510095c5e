"""Property tests of the built-in eviction planners (pure Python, no vLLM): over many
seeded random request histories, the budget is never exceeded, sinks and the recent window
are always kept, pinned (prefix-shared) blocks are never dropped, a dropped block is never
kept again, and deterministic planners answer the same for the same view."""
import random

import pytest
from pydantic import ValidationError

from vllm_graft.hooks import BlockView, get_registry
from vllm_graft.integration.adapters.kvcompress.keep import check_keep


def build(name, **params):
    entry = get_registry().get("kvcompress", name)
    reg = entry.registration
    return reg.load()(reg.params(**params))


def histories(seed, n=60):
    """Random request histories: block size, prompt length, growth steps (prefill chunks,
    decodes), pinned prefix blocks that stop being shared at some step, scores."""
    rnd = random.Random(seed)
    for _ in range(n):
        bs = rnd.choice([16, 32, 128])
        prompt = rnd.randrange(1, 40 * bs)
        shared = rnd.randrange(0, prompt // bs + 1) if rnd.random() < 0.5 else 0
        unshare_at = rnd.randrange(prompt, prompt + 30 * bs)
        steps, n_tok = [], rnd.randrange(0, prompt + 1)
        while n_tok < prompt + 30 * bs:
            n_tok += rnd.choice([1, 1, 1, rnd.randrange(1, 3 * bs)])
            steps.append(n_tok)
        yield bs, prompt, shared, unshare_at, steps, rnd


PLANNERS = [
    ("streaming", {"budget_blocks": 2, "sink_blocks": 1}),
    ("streaming", {"budget_blocks": 8, "sink_blocks": 2}),
    ("streaming", {"budget_blocks": 5, "sink_blocks": 0}),
    ("h2o", {"budget_blocks": 4, "sink_blocks": 1, "recent_blocks": 1}),
    ("h2o", {"budget_blocks": 8, "sink_blocks": 2, "recent_blocks": 3}),
    ("h2o", {"budget_blocks": 2, "sink_blocks": 0, "recent_blocks": 2}),
    ("h2o", {"budget_blocks": 6, "sink_blocks": 1, "recent_blocks": 2, "score": "mean"}),
]


@pytest.mark.parametrize("name, params", PLANNERS)
def test_planner_properties_over_random_histories(name, params):
    comp = build(name, **params)
    budget, sink = params["budget_blocks"], params.get("sink_blocks", 1)
    window = params.get("recent_blocks", budget - sink)
    for bs, prompt, shared, unshare_at, steps, rnd in histories(hash(str(params)) & 0xFFFF):
        dropped: set[int] = set()
        scores: list[float] = []
        for n_tok in steps:
            nb = -(-n_tok // bs)
            while len(scores) < nb:
                scores.append(rnd.random())
            pinned = frozenset(range(shared)) if n_tok < unshare_at else frozenset()
            pinned = frozenset(i for i in pinned if i < nb - 1 and i not in dropped)
            shown = tuple(float("-inf") if i in dropped else scores[i] for i in range(nb))  # as the adapter shows them
            view = BlockView(n_tok, bs, prompt, shown if comp.needs_scores else None, pinned)
            kept = check_keep(view, comp.keep(view), name)  # sorted, in range, last + pinned kept
            own = set(kept) - pinned
            assert len(own) <= budget, (view, kept)  # the budget (pinned blocks come on top)
            assert set(range(min(sink, nb))) <= set(kept)  # sinks
            assert set(range(max(0, nb - window), nb)) <= set(kept)  # the recent window
            assert pinned <= set(kept)  # shared prefix blocks are never freed
            assert not (dropped & set(kept)), "a dropped block came back"
            if nb <= budget:
                assert kept == list(range(nb))  # nothing dropped while within budget
            if not comp.needs_scores:
                assert comp.keep(view) == kept
                unpinned = BlockView(n_tok, bs, prompt, None, frozenset())
                assert sorted(set(comp.keep(unpinned)) | pinned) == kept
            dropped |= set(range(nb)) - set(kept)


def test_streaming_within_budget_is_the_identity_and_evicts_the_middle():
    s = build("streaming", budget_blocks=4, sink_blocks=1)
    assert s.keep(BlockView(4 * 32, 32, 10)) == [0, 1, 2, 3]
    assert s.keep(BlockView(4 * 32 + 1, 32, 10)) == [0, 2, 3, 4]
    assert s.keep(BlockView(10 * 32, 32, 10, pinned=frozenset({1}))) == [0, 1, 7, 8, 9]


@pytest.mark.parametrize("params, msg", [
    ({"budget_blocks": 1}, "greater than or equal to 2"),
    ({"budget_blocks": 4, "sink_blocks": 4}, "sink_blocks (4) must be smaller than budget_blocks (4)"),
    ({"budget_blocks": 4, "sink_blocks": -1}, "greater than or equal to 0"),
    ({"budget_blocks": 4, "window": 2}, "Extra inputs are not permitted"),
])
def test_streaming_rejects_bad_parameters(params, msg):
    reg = get_registry().get("kvcompress", "streaming").registration
    with pytest.raises(ValidationError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        reg.params(**params)


def test_snapkv_recent_blocks_keeps_the_prompts_end_besides_the_window():
    prompt = 10 * 32 + 5  # 11 prompt blocks; the window (32 tokens) is in blocks 9, 10
    scores = (5.0, 1.0, 2.0, 9.0, 0.1, 0.2, 0.3, 4.0, 0.0, 1.0, 1.0)
    view = BlockView(prompt, 32, prompt, scores)
    # recent 3: blocks 8, 9, 10 kept whatever their score; one block of room: block 3 (9.0)
    assert build("snapkv", budget_blocks=5, sink_blocks=1, recent_blocks=3).keep(view) == [0, 3, 8, 9, 10]
    # recent no larger than the window's blocks: the paper's choice
    assert build("snapkv", budget_blocks=5, sink_blocks=1, recent_blocks=2).keep(view) == \
        build("snapkv", budget_blocks=5, sink_blocks=1).keep(view) == [0, 3, 7, 9, 10]
    rnd = random.Random(5)
    for _ in range(200):  # prompt blocks within the budget; sinks, window, recent and generated kept
        budget, recent = rnd.randrange(3, 12), rnd.randrange(0, 4)
        s = build("snapkv", budget_blocks=budget, sink_blocks=1, recent_blocks=min(recent, budget - 1))
        prompt = rnd.randrange(1, 40 * 32)
        n = prompt + rnd.randrange(0, 300)
        nb, pb = -(-n // 32), -(-prompt // 32)
        got = s.keep(BlockView(n, 32, prompt, tuple(rnd.random() for _ in range(nb))))
        if pb <= budget:
            assert got == list(range(nb))
            continue
        assert len([i for i in got if i < pb]) <= budget
        assert set(range(max(0, pb - min(recent, budget - 1)), nb)) | {0} <= set(got)
    with pytest.raises(ValidationError, match=r"sink_blocks \+ recent_blocks \(1 \+ 4\)"):
        get_registry().get("kvcompress", "snapkv").registration.params(budget_blocks=4, recent_blocks=4)


def test_h2o_keeps_the_heaviest_blocks_besides_sinks_and_the_window():
    h = build("h2o", budget_blocks=4, sink_blocks=1, recent_blocks=1)
    scores = (9.0, 1.0, 7.0, 0.5, 8.0, 3.0, 2.0)
    assert h.keep(BlockView(7 * 32, 32, 10, scores)) == [0, 2, 4, 6]
    scores = (9.0, 1.0, float("-inf"), 0.5, 8.0, 3.0, 2.0)  # block 2 dropped earlier
    assert h.keep(BlockView(7 * 32, 32, 10, scores)) == [0, 4, 5, 6]
    assert h.keep(BlockView(4 * 32, 32, 10, (0.0,) * 4)) == [0, 1, 2, 3]  # within budget


def test_h2o_mean_score_divides_by_the_queries_that_could_attend():
    """score: mean ranks by attention per query since the block's first token: an old block
    with a large sum but little per query loses to a younger block attended more per query."""
    scores = (9.0, 60.0, 1.0, 40.0, 3.0, 2.0)  # 6 blocks of 32, 192 tokens
    assert build("h2o", budget_blocks=3, sink_blocks=1, recent_blocks=1).keep(
        BlockView(6 * 32, 32, 10, scores)) == [0, 1, 5]  # sum: block 1 (60) beats block 3 (40)
    # mean: block 1 60 / (192 - 32) = 0.375; block 3 40 / (192 - 96) = 0.42
    assert build("h2o", budget_blocks=3, sink_blocks=1, recent_blocks=1, score="mean").keep(
        BlockView(6 * 32, 32, 10, scores)) == [0, 3, 5]


def test_snapkv_compresses_the_prompt_once_prefilled_by_the_window_attention():
    s = build("snapkv", budget_blocks=4, window_tokens=32, sink_blocks=1)
    prompt = 10 * 32 + 5  # 11 prompt blocks; the window covers tokens 293..324: blocks 9, 10
    assert s.score_positions(prompt) == (prompt - 32, prompt)
    scores = tuple([5.0, 1.0, 2.0, 9.0, 0.1, 0.2, 0.3, 4.0, 0.0, 1.0, 1.0])
    mid = BlockView(8 * 32, 32, prompt, scores[:8])  # prefill not finished: keep all
    assert s.keep(mid) == list(range(8))
    kept = s.keep(BlockView(prompt, 32, prompt, scores))
    assert kept == [0, 3, 9, 10]  # sink, the top-scored prompt block, the window's blocks
    # generation: new blocks are kept, the prompt selection stays (dropped have -inf)
    later = tuple(float("-inf") if i not in kept else v for i, v in enumerate(scores)) + (0.0, 0.0)
    assert s.keep(BlockView(prompt + 60, 32, prompt, later)) == [0, 3, 9, 10, 11, 12]
    for n in range(prompt, prompt + 200, 7):  # never over budget on prompt blocks
        nb = -(-n // 32)
        sc = tuple(float("-inf") if (i < 11 and i not in kept) else 1.0 for i in range(nb))
        got = s.keep(BlockView(n, 32, prompt, sc))
        assert len([i for i in got if i * 32 < prompt]) <= 4 and set(got) >= {0, 9, 10, nb - 1}
