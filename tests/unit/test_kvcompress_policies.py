"""Property tests of the built-in eviction planners (pure Python, no vLLM): over many
seeded random request histories, the budget is never exceeded, sinks and the recent window
are always kept, pinned (prefix-shared) blocks are never dropped, a dropped block is never
kept again, and deterministic planners answer the same for the same view."""
import random

import pytest
from pydantic import ValidationError

from vllm_graft.hooks import BlockView, get_registry
from vllm_graft.hooks.contracts import check_keep


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
]


@pytest.mark.parametrize("name, params", PLANNERS)
def test_planner_properties_over_random_histories(name, params):
    comp = build(name, **params)
    budget, sink = params["budget_blocks"], params.get("sink_blocks", 1)
    window = budget - sink
    for bs, prompt, shared, unshare_at, steps, rnd in histories(hash(str(params)) & 0xFFFF):
        dropped: set[int] = set()
        scores: list[float] = []
        for n_tok in steps:
            nb = -(-n_tok // bs)
            while len(scores) < nb:
                scores.append(rnd.random())
            pinned = frozenset(range(shared)) if n_tok < unshare_at else frozenset()
            pinned = frozenset(i for i in pinned if i < nb - 1 and i not in dropped)
            view = BlockView(n_tok, bs, prompt, tuple(scores[:nb]) if comp.needs_scores else None, pinned)
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
